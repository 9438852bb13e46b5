// URL items: file:// below --allowed-local-media-path, http(s):// from --allowed-media-domains (see
// media-url.h).
#include "server/media-url.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <memory>
#include <optional>
#include <thread>

#include <fmt/format.h>

#include "fovea/error.h"
#include "fovea/io.h"
#include "fovea/json.h"
#include "fovea/threads.h"
#include "server/request.h"

#ifdef FOVEA_HAVE_CURL
#include <curl/curl.h>
#endif

namespace fovea::server {

namespace {

std::string lower(std::string s) {
  for (char& ch : s) ch = char(std::tolower(static_cast<unsigned char>(ch)));
  return s;
}

std::string shown(const std::string& url) { return quote_for_error(url, 120); }

[[noreturn]] void bad_url(const std::string& name, const std::string& url, const std::string& why) {
  reject(400, "invalid_url", fmt::format("{}: {}: {}", name, shown(url), why));
}

// Takes `bytes` more of the budget without waiting; false if they do not fit now.
bool take(ByteBudget& budget, int64_t bytes, int64_t& held) {
  if (!budget.acquire(bytes, Clock::now())) return false;
  held += bytes;
  return true;
}

[[noreturn]] void no_room(const ByteBudget& budget, const std::string& name, const std::string& url) {
  reject(503, "server_busy",
         fmt::format("{}: {}: no room for its bytes now (the items being read hold {} of {} bytes, "
                     "--max-body-bytes-in-flight); retry later",
                     name, shown(url), budget.used(), budget.capacity()));
}

// A file:// URL's path: "file://" then an empty authority or "localhost", then an absolute path,
// percent-decoded; "" if the URL is not of that form.
std::string file_url_path(const std::string& url) {
  std::string rest = url.substr(7);  // after "file://"
  if (rest.starts_with("localhost/")) rest.erase(0, 9);
  if (!rest.starts_with("/")) return "";
  std::string out;
  for (size_t i = 0; i < rest.size(); ++i) {
    if (rest[i] != '%') {
      out += rest[i];
      continue;
    }
    const auto hex = [&](size_t k) -> int {
      if (k >= rest.size() || !std::isxdigit(static_cast<unsigned char>(rest[k]))) return -1;
      const char ch = char(std::tolower(static_cast<unsigned char>(rest[k])));
      return ch <= '9' ? ch - '0' : ch - 'a' + 10;
    };
    const int hi = hex(i + 1), lo = hex(i + 2);
    if (hi < 0 || lo < 0 || (hi == 0 && lo == 0)) return "";  // a bad escape, or a NUL
    out += char(hi * 16 + lo);
    i += 2;
  }
  return out;
}

// `path` relative to `root` if it lies lexically below it ("" otherwise).
std::string below(const std::string& path, std::string root) {
  while (root.size() > 1 && root.back() == '/') root.pop_back();
  if (root == "/") return path.substr(1);
  return path.size() > root.size() + 1 && path.starts_with(root + "/") ? path.substr(root.size() + 1) : "";
}

// Opens `rel` beneath the folder `dir_fd`: the kernel refuses any step out of it ("..", a symlink
// leading out) and every absolute symlink, even one pointing inside (checking where it points would
// race with whoever can change it). O_NONBLOCK: a FIFO planted there must not hang the open.
int open_beneath(int dir_fd, const std::string& rel) {
  open_how how{};
  how.flags = O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK;
  how.resolve = RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS;
  return int(syscall(SYS_openat2, dir_fd, rel.c_str(), &how, sizeof how));
}

std::string open_failure(int err) {
  switch (err) {
    case ENOENT:
    case ENOTDIR: return "no such file below --allowed-local-media-path";
    case EXDEV:
    case ELOOP:
      return "it leads out of --allowed-local-media-path (through \"..\" or a symlink), or through an absolute "
             "symlink (only relative symlinks that stay inside are followed)";
    case EACCES:
    case EPERM: return "permission denied";
    case ENOSYS: return "this kernel cannot open a file strictly beneath a folder (openat2, Linux 5.6)";
    default: return std::strerror(err);
  }
}

}  // namespace

#ifdef FOVEA_HAVE_CURL
// The fetching thread: one libcurl multi handle drives every transfer (media-url.h).
class Fetcher {
 public:
  struct Transfer;
  Fetcher();
  ~Fetcher();  // what still runs ends with 503 shutting_down
  Fetcher(const Fetcher&) = delete;
  Fetcher& operator=(const Fetcher&) = delete;
  void start(std::unique_ptr<Transfer> t);
  void abort_all(const ApiError& why);

 private:
  void loop();
  void begin(std::unique_ptr<Transfer> t);
  void ended(std::unique_ptr<Transfer> t, CURLcode rc);
  // Takes `t` by reference: callers build the error from t's fields in the same call, and the
  // order in which arguments are evaluated is unspecified.
  void finish(std::unique_ptr<Transfer>&& t, std::optional<ApiError> error);
  void expire(Clock::time_point now);
  std::unique_ptr<Transfer> take_running(CURL* easy);

  CURLM* multi_;
  std::vector<std::unique_ptr<Transfer>> running_;  // the loop's alone
  std::mutex mu_;                                   // guards the three below
  std::vector<std::unique_ptr<Transfer>> incoming_;
  std::optional<ApiError> abort_;
  bool stopping_ = false;
  std::thread thread_;
};
#else
class Fetcher {};
#endif

MediaSources::MediaSources(const ServeOptions& o)
    : local_root_(o.allowed_local_media_path),
      private_ok_(o.allow_private_media_urls),
      timeout_s_(o.media_fetch_timeout_s),
      max_bytes_(int64_t(o.http.max_body_bytes)) {
  if (!local_root_.empty()) {
    char* real = ::realpath(local_root_.c_str(), nullptr);
    if (!real) throw Error(fmt::format("--allowed-local-media-path {}: {}", local_root_, std::strerror(errno)));
    local_real_ = real;
    std::free(real);
    local_fd_ = Fd(::open(local_real_.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
    if (!local_fd_)
      throw Error(fmt::format("--allowed-local-media-path {}: not a folder fovea can open: {}", local_root_,
                              std::strerror(errno)));
  }
  for (const std::string& d : o.allowed_media_domains) {
    if (d.empty()) continue;
    if (d == "*") any_domain_ = true;
    domains_.push_back(lower(d));
  }
  if (!domains_.empty() && !http_media_supported())
    throw Error("--allowed-media-domains: this build of fovea cannot fetch http(s) URLs (built without libcurl)");
  if (!(timeout_s_ > 0) || timeout_s_ > 3600)
    throw Error("--media-fetch-timeout must be more than 0 and at most 3600 seconds");
#ifdef FOVEA_HAVE_CURL
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
  if (!domains_.empty()) fetcher_ = std::make_unique<Fetcher>();
#endif
}

MediaSources::~MediaSources() = default;

std::string MediaSources::describe() const {
  std::string files = local_fd_ ? fmt::format("file:// below {}", local_real_) : "no file://";
  std::string web = domains_.empty() ? "no http(s)://"
                    : any_domain_    ? "http(s):// from any host"
                                     : fmt::format("http(s):// from {}", fmt::join(domains_, ", "));
  if (!domains_.empty()) web += private_ok_ ? " (private addresses too)" : " (public addresses only)";
  return files + "; " + web;
}

bool MediaSources::domain_allowed(const std::string& host) const {
  return any_domain_ || std::find(domains_.begin(), domains_.end(), lower(host)) != domains_.end();
}

bool MediaSources::is_http(const std::string& url) {
  const std::string scheme = lower(url.substr(0, std::min<size_t>(url.find(':'), 8)));
  return scheme == "http" || scheme == "https";
}

std::vector<uint8_t> MediaSources::read(const std::string& url, const std::string& name, ByteBudget& budget,
                                        int64_t& held) const {
  if (!lower(url).starts_with("file:")) bad_url(name, url, "not a URL fovea reads (data:, file://, http://, https://)");
  if (!lower(url).starts_with("file://")) bad_url(name, url, "a file URL is file:///absolute/path");
  if (!local_fd_)
    bad_url(name, url, "file:// URLs are read only below --allowed-local-media-path, which this server was not given");
  const std::string path = file_url_path(url);
  if (path.empty()) bad_url(name, url, "a file URL is file:///absolute/path (percent-escapes allowed, no NUL)");
  std::string rel = below(path, local_root_);
  if (rel.empty()) rel = below(path, local_real_);
  if (rel.empty()) bad_url(name, url, fmt::format("not below --allowed-local-media-path ({})", local_root_));
  const Fd fd(open_beneath(local_fd_.get(), rel));
  if (!fd) bad_url(name, url, open_failure(errno));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) bad_url(name, url, "not a regular file");
  if (st.st_size > max_bytes_)
    bad_url(name, url,
            fmt::format("{} bytes, more than an item may be ({}, --max-body-bytes)", st.st_size, max_bytes_));
  if (!take(budget, st.st_size, held)) no_room(budget, name, url);
  std::vector<uint8_t> bytes(size_t(st.st_size));
  const ssize_t got = pread_full(fd.get(), bytes.data(), bytes.size(), 0);
  if (got < 0) bad_url(name, url, std::strerror(errno));
  if (size_t(got) < bytes.size()) bad_url(name, url, "the file shrank while it was read");
  return bytes;
}

namespace {

const char* const kPrivate = "a loopback or private address (--allow-private-media-urls allows them)";

std::string v4_problem(uint32_t v4, bool private_ok) {
  const auto in = [&](uint32_t net, int bits) { return (v4 >> (32 - bits)) == (net >> (32 - bits)); };
  if (in(0xA9FE0000, 16) || in(0x00000000, 8) || in(0xE0000000, 4) || v4 == 0xFFFFFFFF)
    return "a link-local, unspecified, multicast or broadcast address";
  const bool priv = in(0x7F000000, 8) || in(0x0A000000, 8) || in(0xAC100000, 12) || in(0xC0A80000, 16) ||
                    in(0x64400000, 10);  // loopback, RFC 1918, carrier-grade NAT
  return priv && !private_ok ? kPrivate : "";
}

uint32_t v4_at(const in6_addr& a, int at) {
  return uint32_t(a.s6_addr[at]) << 24 | uint32_t(a.s6_addr[at + 1]) << 16 | uint32_t(a.s6_addr[at + 2]) << 8 |
         a.s6_addr[at + 3];
}

bool starts_with_bytes(const in6_addr& a, std::initializer_list<uint8_t> prefix) {
  return std::equal(prefix.begin(), prefix.end(), a.s6_addr);
}

// The IPv4 addresses an IPv6 address stands for, where a translator or a tunnel would deliver it to
// IPv4 (RFC 4291 mapped and compatible, RFC 6145 translated, RFC 6052 NAT64 with the well-known
// prefix 64:ff9b::/96, RFC 3056 6to4, RFC 4380 Teredo's server and client, RFC 5214 ISATAP
// interface ids). The local-use NAT64 prefix 64:ff9b:1::/48 is local_use_nat64's.
std::vector<uint32_t> embedded_v4(const in6_addr& a) {
  const auto zero = [&](int from, int to) {
    return std::all_of(a.s6_addr + from, a.s6_addr + to, [](uint8_t b) { return b == 0; });
  };
  std::vector<uint32_t> out;
  if (zero(0, 10) && a.s6_addr[10] == 0xff && a.s6_addr[11] == 0xff) out.push_back(v4_at(a, 12));  // ::ffff:a.b.c.d
  if (zero(0, 8) && a.s6_addr[8] == 0xff && a.s6_addr[9] == 0xff && zero(10, 12))
    out.push_back(v4_at(a, 12));                                     // ::ffff:0:a.b.c.d
  if (zero(0, 12) && v4_at(a, 12) > 1) out.push_back(v4_at(a, 12));  // ::a.b.c.d (not :: or ::1)
  if (starts_with_bytes(a, {0x00, 0x64, 0xff, 0x9b}) && zero(4, 12)) out.push_back(v4_at(a, 12));  // 64:ff9b::/96
  if (starts_with_bytes(a, {0x20, 0x02})) out.push_back(v4_at(a, 2));                              // 6to4 2002::/16
  if (starts_with_bytes(a, {0x20, 0x01, 0x00, 0x00})) {                                            // Teredo 2001::/32
    out.push_back(v4_at(a, 4));                                                                    // the server
    out.push_back(~v4_at(a, 12));  // the client, obfuscated
  }
  if ((a.s6_addr[8] & 0xfd) == 0 && a.s6_addr[9] == 0 && a.s6_addr[10] == 0x5e && a.s6_addr[11] == 0xfe)
    out.push_back(v4_at(a, 12));  // ISATAP ::0:5efe:a.b.c.d or ::200:5efe:a.b.c.d
  return out;
}

// RFC 8215's local-use NAT64 prefix 64:ff9b:1::/48: a translator of the site's own, which may put
// the IPv4 address at any RFC 6052 place (prefix /48 to /96), so it is private as a whole, and never
// allowed where any of those places reads as a link-local address.
std::string local_use_nat64(const in6_addr& a, bool private_ok) {
  const auto pick = [&](std::initializer_list<int> at) {
    uint32_t v = 0;
    for (int k : at) v = v << 8 | a.s6_addr[k];
    return v;
  };
  for (const uint32_t v4 : {pick({6, 7, 9, 10}), pick({7, 9, 10, 11}), pick({9, 10, 11, 12}), v4_at(a, 12)})
    if ((v4 >> 16) == 0xA9FE) return "a link-local address (embedded in a local-use NAT64 address)";
  return private_ok ? "" : std::string(kPrivate) + " (a local-use NAT64 address)";
}

}  // namespace

std::string address_problem(const sockaddr* sa, bool private_ok) {
  if (sa->sa_family == AF_INET)
    return v4_problem(ntohl(reinterpret_cast<const sockaddr_in*>(sa)->sin_addr.s_addr), private_ok);
  if (sa->sa_family != AF_INET6) return "not an IP address";
  const in6_addr& a = reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr;
  if (starts_with_bytes(a, {0x00, 0x64, 0xff, 0x9b, 0x00, 0x01})) return local_use_nat64(a, private_ok);
  for (const uint32_t v4 : embedded_v4(a))
    if (std::string why = v4_problem(v4, private_ok); !why.empty()) return why + " (embedded in an IPv6 address)";
  if (IN6_IS_ADDR_LINKLOCAL(&a) || IN6_IS_ADDR_UNSPECIFIED(&a) || IN6_IS_ADDR_MULTICAST(&a) ||
      IN6_IS_ADDR_SITELOCAL(&a))
    return "a link-local, site-local, unspecified or multicast address";
  const bool priv = IN6_IS_ADDR_LOOPBACK(&a) || (a.s6_addr[0] & 0xfe) == 0xfc;  // ::1, unique local fc00::/7
  return priv && !private_ok ? kPrivate : "";
}

#ifdef FOVEA_HAVE_CURL

bool http_media_supported() { return true; }

namespace {

// One transfer's state, seen by libcurl's callbacks. What its buffer holds of the budget is its
// capacity, not its size: with a Content-Length that many bytes at once, else room grown by doubling
// from 64 KiB; each growth is taken before it is made and the old buffer given back after, so the
// budget counts both while both exist. Never more than max_bytes.
struct Sink {
  CURL* easy = nullptr;
  std::vector<uint8_t> bytes;
  int64_t max_bytes = 0;
  ByteBudget* budget = nullptr;
  int64_t held = 0;
  bool private_ok = false;
  std::string refused;  // why the transfer was stopped by fovea: too large, no room, an address
  int status = 0;       // 503 when the budget had no room

  bool room_for(size_t need) {
    const size_t had = bytes.capacity();
    if (need <= had) return true;
    curl_off_t length = -1;
    if (had == 0) curl_easy_getinfo(easy, CURLINFO_CONTENT_LENGTH_DOWNLOAD_T, &length);
    size_t cap = length >= curl_off_t(need) ? size_t(length) : std::max({need, size_t(64) << 10, 2 * had});
    cap = std::min(cap, size_t(max_bytes));
    if (!take(*budget, int64_t(cap), held)) {
      refused = "no room";
      status = 503;
      return false;
    }
    bytes.reserve(cap);
    budget->release(int64_t(had));
    held -= int64_t(had);
    return true;
  }
  void drop() {  // the buffer freed and its room given back
    std::vector<uint8_t>().swap(bytes);
    budget->release(held);
    held = 0;
  }
};

size_t on_data(char* data, size_t size, size_t n, void* p) {
  Sink& s = *static_cast<Sink*>(p);
  const size_t bytes = size * n;
  if (int64_t(s.bytes.size() + bytes) > s.max_bytes) {
    s.refused = fmt::format("more than {} bytes (--max-body-bytes)", s.max_bytes);
    return 0;  // aborts the transfer
  }
  if (!s.room_for(s.bytes.size() + bytes)) return 0;
  s.bytes.insert(s.bytes.end(), data, data + bytes);
  return bytes;
}

curl_socket_t on_socket(void* p, curlsocktype, curl_sockaddr* a) {
  Sink& s = *static_cast<Sink*>(p);
  if (std::string why = address_problem(&a->addr, s.private_ok); !why.empty()) {
    char text[INET6_ADDRSTRLEN] = "?";
    const void* raw = a->family == AF_INET
                          ? static_cast<const void*>(&reinterpret_cast<const sockaddr_in*>(&a->addr)->sin_addr)
                          : static_cast<const void*>(&reinterpret_cast<const sockaddr_in6*>(&a->addr)->sin6_addr);
    inet_ntop(a->family, raw, text, sizeof text);
    s.refused = fmt::format("its host resolves to {}, {}", text, why);
    return CURL_SOCKET_BAD;
  }
  return ::socket(a->family, a->socktype | SOCK_CLOEXEC, a->protocol);
}

// The URL's scheme and host as libcurl parses them; false if it cannot.
bool url_parts(const std::string& url, std::string& scheme, std::string& host) {
  CURLU* u = curl_url();
  char *s = nullptr, *h = nullptr;
  const bool ok = curl_url_set(u, CURLUPART_URL, url.c_str(), 0) == CURLUE_OK &&
                  curl_url_get(u, CURLUPART_SCHEME, &s, 0) == CURLUE_OK &&
                  curl_url_get(u, CURLUPART_HOST, &h, 0) == CURLUE_OK;
  if (ok) {
    scheme = lower(s);
    host = lower(h);
    if (host.size() > 2 && host.front() == '[') host = host.substr(1, host.size() - 2);
  }
  curl_free(s);
  curl_free(h);
  curl_url_cleanup(u);
  return ok;
}

ApiError url_error(const std::string& name, const std::string& url, const std::string& why) {
  return {400, "invalid_url", fmt::format("{}: {}: {}", name, shown(url), why)};
}

}  // namespace

// One URL being fetched, hop after hop, on the fetcher's thread.
struct Fetcher::Transfer {
  std::string first, url, name;
  int hop = 0;
  Clock::time_point deadline, stop;  // the request's; this fetch's (--media-fetch-timeout too)
  const MediaSources* from = nullptr;
  Sink sink;
  CURL* easy = nullptr;
  char error[CURL_ERROR_SIZE] = "";
  FetchDone done;
  std::shared_ptr<const std::atomic<bool>> cancel;
  ~Transfer() {
    if (easy) curl_easy_cleanup(easy);
  }
};

Fetcher::Fetcher() : multi_(curl_multi_init()) {
  curl_multi_setopt(multi_, CURLMOPT_MAX_HOST_CONNECTIONS, long(kFetchesPerHost));
  curl_multi_setopt(multi_, CURLMOPT_MAX_TOTAL_CONNECTIONS, long(kFetchesAtOnce));
  thread_ = std::thread([this] {
    name_this_thread("fovea-fetch");
    loop();
  });
}

Fetcher::~Fetcher() {
  abort_all({503, "shutting_down", "the server is shutting down"});
  {
    std::lock_guard lk(mu_);
    stopping_ = true;
  }
  curl_multi_wakeup(multi_);
  thread_.join();
  curl_multi_cleanup(multi_);
}

void Fetcher::start(std::unique_ptr<Transfer> t) {
  {
    std::lock_guard lk(mu_);
    incoming_.push_back(std::move(t));
  }
  curl_multi_wakeup(multi_);
}

void Fetcher::abort_all(const ApiError& why) {
  {
    std::lock_guard lk(mu_);
    abort_ = why;
  }
  curl_multi_wakeup(multi_);
}

void Fetcher::finish(std::unique_ptr<Transfer>&& owned, std::optional<ApiError> error) {
  std::unique_ptr<Transfer> t = std::move(owned);
  if (t->easy) curl_multi_remove_handle(multi_, t->easy);
  Fetched out;
  if (error) {
    t->sink.drop();
    out.error = std::move(error);
  } else {
    out.bytes = std::move(t->sink.bytes);
    out.held = std::exchange(t->sink.held, 0);
  }
  FetchDone done = std::move(t->done);
  t.reset();
  done(std::move(out));
}

// The transfer's current hop checked (scheme, host) and handed to libcurl.
void Fetcher::begin(std::unique_ptr<Transfer> t) {
  std::string scheme, host;
  if (!url_parts(t->url, scheme, host))
    return finish(std::move(t), url_error(t->name, t->url, "not a URL libcurl can parse"));
  if (scheme != "http" && scheme != "https")
    return finish(std::move(t), url_error(t->name, t->url, "redirected to a scheme other than http(s)"));
  if (!t->from->domain_allowed(host))
    return finish(
        std::move(t),
        url_error(t->name, t->url, fmt::format("host {} is not in --allowed-media-domains", quote_for_error(host))));
  if (t->easy) curl_easy_cleanup(t->easy);
  CURL* e = t->easy = curl_easy_init();
  t->sink.easy = e;
  t->error[0] = 0;
  curl_easy_setopt(e, CURLOPT_URL, t->url.c_str());
  curl_easy_setopt(e, CURLOPT_PROTOCOLS_STR, "http,https");
  curl_easy_setopt(e, CURLOPT_FOLLOWLOCATION, 0L);  // followed here, each hop checked
  curl_easy_setopt(e, CURLOPT_PROXY, "");           // no proxy from the environment: the address check is the host's
  curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(e, CURLOPT_MAXFILESIZE_LARGE, curl_off_t(t->sink.max_bytes));
  curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, on_data);
  curl_easy_setopt(e, CURLOPT_WRITEDATA, &t->sink);
  curl_easy_setopt(e, CURLOPT_OPENSOCKETFUNCTION, on_socket);
  curl_easy_setopt(e, CURLOPT_OPENSOCKETDATA, &t->sink);
  curl_easy_setopt(e, CURLOPT_ERRORBUFFER, t->error);
  curl_easy_setopt(e, CURLOPT_USERAGENT, "fovea");
  curl_easy_setopt(e, CURLOPT_PRIVATE, t.get());
  curl_multi_add_handle(multi_, e);
  running_.push_back(std::move(t));
}

// A hop ended (rc from libcurl): the bytes, the next hop, or the error.
void Fetcher::ended(std::unique_ptr<Transfer> t, CURLcode rc) {
  Sink& s = t->sink;
  if (rc != CURLE_OK) {
    if (s.status == 503)
      return finish(std::move(t),
                    ApiError{503, "server_busy",
                             fmt::format("{}: {}: no room for its bytes now (the items being read hold {} of {} "
                                         "bytes, --max-body-bytes-in-flight); retry later",
                                         t->name, shown(t->url), s.budget->used(), s.budget->capacity())});
    if (!s.refused.empty()) return finish(std::move(t), url_error(t->name, t->url, s.refused));
    if (rc == CURLE_FILESIZE_EXCEEDED)
      return finish(std::move(t),
                    url_error(t->name, t->url, fmt::format("more than {} bytes (--max-body-bytes)", s.max_bytes)));
    return finish(std::move(t),
                  url_error(t->name, t->url,
                            fmt::format("could not fetch it: {}", *t->error ? t->error : curl_easy_strerror(rc))));
  }
  long code = 0;
  curl_easy_getinfo(t->easy, CURLINFO_RESPONSE_CODE, &code);
  if (code >= 200 && code < 300) return finish(std::move(t), std::nullopt);
  char* next = nullptr;
  curl_easy_getinfo(t->easy, CURLINFO_REDIRECT_URL, &next);
  if (code < 300 || code >= 400 || !next)
    return finish(std::move(t), url_error(t->name, t->url, fmt::format("the server answered HTTP {}", code)));
  if (t->hop == kMaxRedirects)
    return finish(std::move(t), url_error(t->name, t->first, fmt::format("more than {} redirects", kMaxRedirects)));
  s.drop();  // a redirect's body is dropped
  t->url = next;
  t->hop += 1;
  curl_multi_remove_handle(multi_, t->easy);
  begin(std::move(t));
}

// Transfers past their stop end: 504 past the request's deadline, else --media-fetch-timeout's 400;
// so do those cancelled (their request failed already: what they end with is never seen).
void Fetcher::expire(Clock::time_point now) {
  for (size_t k = 0; k < running_.size();) {
    const bool cancelled = running_[k]->cancel && running_[k]->cancel->load();
    if (running_[k]->stop > now && !cancelled) {
      ++k;
      continue;
    }
    std::unique_ptr<Transfer> t = std::move(running_[k]);
    running_.erase(running_.begin() + std::ptrdiff_t(k));
    ApiError e = cancelled ? url_error(t->name, t->first, "not needed: another item of its request failed")
                 : now >= t->deadline
                     ? ApiError{504, "timeout",
                                fmt::format("{}: {}: not fetched before the request's deadline (--request-timeout)",
                                            t->name, shown(t->first))}
                     : url_error(t->name, t->first,
                                 fmt::format("not fetched within {} s (--media-fetch-timeout)", t->from->timeout_s_));
    finish(std::move(t), std::move(e));
  }
}

std::unique_ptr<Fetcher::Transfer> Fetcher::take_running(CURL* easy) {
  for (size_t k = 0; k < running_.size(); ++k)
    if (running_[k]->easy == easy) {
      std::unique_ptr<Transfer> t = std::move(running_[k]);
      running_.erase(running_.begin() + std::ptrdiff_t(k));
      return t;
    }
  return nullptr;
}

void Fetcher::loop() {
  for (;;) {
    std::vector<std::unique_ptr<Transfer>> fresh;
    std::optional<ApiError> abort;
    {
      std::lock_guard lk(mu_);
      if (stopping_ && running_.empty() && incoming_.empty()) return;
      fresh.swap(incoming_);
      abort = std::exchange(abort_, std::nullopt);
    }
    for (auto& t : fresh) begin(std::move(t));
    if (abort)
      while (!running_.empty()) {
        std::unique_ptr<Transfer> t = std::move(running_.back());
        running_.pop_back();
        finish(std::move(t), *abort);
      }
    int active = 0;
    curl_multi_perform(multi_, &active);
    int left = 0;
    while (CURLMsg* m = curl_multi_info_read(multi_, &left))
      if (m->msg == CURLMSG_DONE)
        if (std::unique_ptr<Transfer> t = take_running(m->easy_handle)) ended(std::move(t), m->data.result);
    expire(Clock::now());
    Clock::time_point next = Clock::now() + std::chrono::milliseconds(200);
    for (const auto& t : running_) next = std::min(next, t->stop);
    const auto wait_ms = std::chrono::duration_cast<std::chrono::milliseconds>(next - Clock::now()).count();
    curl_multi_poll(multi_, nullptr, 0, int(std::clamp<int64_t>(wait_ms + 1, 1, 200)), nullptr);
  }
}

void MediaSources::fetch(const std::string& url, const std::string& name, Clock::time_point deadline,
                         ByteBudget& budget, FetchDone done, std::shared_ptr<const std::atomic<bool>> cancel) const {
  if (domains_.empty())
    bad_url(name, url, "http(s) URLs are fetched only from --allowed-media-domains, which this server was not given");
  auto t = std::make_unique<Fetcher::Transfer>();
  t->first = t->url = url;
  t->name = name;
  t->deadline = deadline;
  t->stop = std::min(deadline, Clock::now() + from_seconds(timeout_s_));
  t->from = this;
  t->sink.max_bytes = max_bytes_;
  t->sink.budget = &budget;
  t->sink.private_ok = private_ok_;
  t->done = std::move(done);
  t->cancel = std::move(cancel);
  fetcher_->start(std::move(t));
}

void MediaSources::abort_fetches(const ApiError& why) const {
  if (fetcher_) fetcher_->abort_all(why);
}

#else

bool http_media_supported() { return false; }

void MediaSources::fetch(const std::string& url, const std::string& name, Clock::time_point, ByteBudget&, FetchDone,
                         std::shared_ptr<const std::atomic<bool>>) const {
  bad_url(name, url, "this build of fovea cannot fetch http(s) URLs (built without libcurl)");
}

void MediaSources::abort_fetches(const ApiError&) const {}

#endif

}  // namespace fovea::server
