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

#include <fmt/format.h>

#include "fovea/error.h"
#include "fovea/json.h"
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
    case ENOENT: case ENOTDIR: return "no such file below --allowed-local-media-path";
    case EXDEV: case ELOOP:
      return "it leads out of --allowed-local-media-path (through \"..\" or a symlink), or through an absolute "
             "symlink (only relative symlinks that stay inside are followed)";
    case EACCES: case EPERM: return "permission denied";
    case ENOSYS: return "this kernel cannot open a file strictly beneath a folder (openat2, Linux 5.6)";
    default: return std::strerror(err);
  }
}

}  // namespace

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
    local_fd_ = ::open(local_real_.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (local_fd_ < 0)
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
  if (!(timeout_s_ > 0) || timeout_s_ > 3600) throw Error("--media-fetch-timeout must be more than 0 and at most 3600 seconds");
#ifdef FOVEA_HAVE_CURL
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
#endif
}

MediaSources::~MediaSources() {
  if (local_fd_ >= 0) ::close(local_fd_);
}

std::string MediaSources::describe() const {
  std::string files = local_fd_ >= 0 ? fmt::format("file:// below {}", local_real_) : "no file://";
  std::string web = domains_.empty() ? "no http(s)://"
                    : any_domain_   ? "http(s):// from any host"
                                    : fmt::format("http(s):// from {}", fmt::join(domains_, ", "));
  if (!domains_.empty()) web += private_ok_ ? " (private addresses too)" : " (public addresses only)";
  return files + "; " + web;
}

bool MediaSources::domain_allowed(const std::string& host) const {
  return any_domain_ || std::find(domains_.begin(), domains_.end(), lower(host)) != domains_.end();
}

std::vector<uint8_t> MediaSources::read(const std::string& url, const std::string& name, Clock::time_point deadline,
                                        ByteBudget& budget, int64_t& held) const {
  const std::string scheme = lower(url.substr(0, std::min<size_t>(url.find(':'), 8)));
  if (scheme == "file") {
    if (!lower(url).starts_with("file://")) bad_url(name, url, "a file URL is file:///absolute/path");
    return read_file(url, name, budget, held);
  }
  if (scheme == "http" || scheme == "https") return fetch(url, name, deadline, budget, held);
  bad_url(name, url, "not a URL fovea reads (data:, file://, http://, https://)");
}

std::vector<uint8_t> MediaSources::read_file(const std::string& url, const std::string& name, ByteBudget& budget,
                                             int64_t& held) const {
  if (local_fd_ < 0)
    bad_url(name, url, "file:// URLs are read only below --allowed-local-media-path, which this server was not given");
  const std::string path = file_url_path(url);
  if (path.empty()) bad_url(name, url, "a file URL is file:///absolute/path (percent-escapes allowed, no NUL)");
  std::string rel = below(path, local_root_);
  if (rel.empty()) rel = below(path, local_real_);
  if (rel.empty()) bad_url(name, url, fmt::format("not below --allowed-local-media-path ({})", local_root_));
  const int fd = open_beneath(local_fd_, rel);
  if (fd < 0) bad_url(name, url, open_failure(errno));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st{};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) bad_url(name, url, "not a regular file");
  if (st.st_size > max_bytes_)
    bad_url(name, url, fmt::format("{} bytes, more than an item may be ({}, --max-body-bytes)", st.st_size, max_bytes_));
  if (!take(budget, st.st_size, held)) no_room(budget, name, url);
  std::vector<uint8_t> bytes(size_t(st.st_size));
  size_t got = 0;
  while (got < bytes.size()) {
    const ssize_t n = ::pread(fd, bytes.data() + got, bytes.size() - got, off_t(got));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) bad_url(name, url, n == 0 ? "the file shrank while it was read" : std::strerror(errno));
    got += size_t(n);
  }
  return bytes;
}

#ifdef FOVEA_HAVE_CURL

bool http_media_supported() { return true; }

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

// Why fovea will not connect to this address ("" if it may): link-local (cloud metadata services
// answer there), unspecified, multicast and broadcast never; loopback and private only if allowed.
std::string address_problem(const sockaddr* sa, bool private_ok) {
  if (sa->sa_family == AF_INET) return v4_problem(ntohl(reinterpret_cast<const sockaddr_in*>(sa)->sin_addr.s_addr), private_ok);
  if (sa->sa_family != AF_INET6) return "not an IP address";
  const in6_addr& a = reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr;
  if (IN6_IS_ADDR_V4MAPPED(&a))
    return v4_problem(uint32_t(a.s6_addr[12]) << 24 | uint32_t(a.s6_addr[13]) << 16 | uint32_t(a.s6_addr[14]) << 8 |
                          a.s6_addr[15], private_ok);
  if (IN6_IS_ADDR_LINKLOCAL(&a) || IN6_IS_ADDR_UNSPECIFIED(&a) || IN6_IS_ADDR_MULTICAST(&a))
    return "a link-local, unspecified or multicast address";
  const bool priv = IN6_IS_ADDR_LOOPBACK(&a) || (a.s6_addr[0] & 0xfe) == 0xfc;  // ::1, unique local fc00::/7
  return priv && !private_ok ? kPrivate : "";
}

// One transfer's state, seen by libcurl's callbacks.
struct Sink {
  std::vector<uint8_t> bytes;
  int64_t max_bytes = 0;
  ByteBudget* budget = nullptr;
  int64_t* held = nullptr;
  bool private_ok = false;
  std::string refused;  // why the transfer was stopped by fovea: too large, no room, an address
  int status = 0;       // 503 when the budget had no room
};

size_t on_data(char* data, size_t size, size_t n, void* p) {
  Sink& s = *static_cast<Sink*>(p);
  const size_t bytes = size * n;
  if (int64_t(s.bytes.size() + bytes) > s.max_bytes) {
    s.refused = fmt::format("more than {} bytes (--max-body-bytes)", s.max_bytes);
    return 0;  // aborts the transfer
  }
  if (!take(*s.budget, int64_t(bytes), *s.held)) {
    s.refused = "no room";
    s.status = 503;
    return 0;
  }
  s.bytes.insert(s.bytes.end(), data, data + bytes);
  return bytes;
}

curl_socket_t on_socket(void* p, curlsocktype, curl_sockaddr* a) {
  Sink& s = *static_cast<Sink*>(p);
  if (std::string why = address_problem(&a->addr, s.private_ok); !why.empty()) {
    char text[INET6_ADDRSTRLEN] = "?";
    const void* raw = a->family == AF_INET ? static_cast<const void*>(&reinterpret_cast<const sockaddr_in*>(&a->addr)->sin_addr)
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
                  curl_url_get(u, CURLUPART_SCHEME, &s, 0) == CURLUE_OK && curl_url_get(u, CURLUPART_HOST, &h, 0) == CURLUE_OK;
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

struct Easy {
  CURL* h = curl_easy_init();
  ~Easy() { curl_easy_cleanup(h); }
};

}  // namespace

std::vector<uint8_t> MediaSources::fetch(const std::string& first, const std::string& name, Clock::time_point deadline,
                                         ByteBudget& budget, int64_t& held) const {
  if (domains_.empty())
    bad_url(name, first, "http(s) URLs are fetched only from --allowed-media-domains, which this server was not given");
  const Clock::time_point stop = std::min(deadline, Clock::now() + from_seconds(timeout_s_));
  std::string url = first;
  for (int hop = 0;; ++hop) {
    std::string scheme, host;
    if (!url_parts(url, scheme, host)) bad_url(name, url, "not a URL libcurl can parse");
    if (scheme != "http" && scheme != "https") bad_url(name, url, "redirected to a scheme other than http(s)");
    if (!domain_allowed(host)) bad_url(name, url, fmt::format("host {} is not in --allowed-media-domains", quote_for_error(host)));
    const int64_t left_ms = std::chrono::duration_cast<std::chrono::milliseconds>(stop - Clock::now()).count();
    if (left_ms <= 0) break;
    Sink sink{{}, max_bytes_, &budget, &held, private_ok_, "", 0};
    Easy e;
    char error[CURL_ERROR_SIZE] = "";
    curl_easy_setopt(e.h, CURLOPT_URL, url.c_str());
    curl_easy_setopt(e.h, CURLOPT_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(e.h, CURLOPT_FOLLOWLOCATION, 0L);  // followed here, each hop checked
    curl_easy_setopt(e.h, CURLOPT_PROXY, "");            // no proxy from the environment: the address check is the host's
    curl_easy_setopt(e.h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(e.h, CURLOPT_TIMEOUT_MS, long(left_ms));
    curl_easy_setopt(e.h, CURLOPT_MAXFILESIZE_LARGE, curl_off_t(max_bytes_));
    curl_easy_setopt(e.h, CURLOPT_WRITEFUNCTION, on_data);
    curl_easy_setopt(e.h, CURLOPT_WRITEDATA, &sink);
    curl_easy_setopt(e.h, CURLOPT_OPENSOCKETFUNCTION, on_socket);
    curl_easy_setopt(e.h, CURLOPT_OPENSOCKETDATA, &sink);
    curl_easy_setopt(e.h, CURLOPT_ERRORBUFFER, error);
    curl_easy_setopt(e.h, CURLOPT_USERAGENT, "fovea");
    const CURLcode rc = curl_easy_perform(e.h);
    if (rc != CURLE_OK) {
      if (sink.status == 503) no_room(budget, name, url);
      if (!sink.refused.empty()) bad_url(name, url, sink.refused);
      if (rc == CURLE_OPERATION_TIMEDOUT) break;
      if (rc == CURLE_FILESIZE_EXCEEDED)
        bad_url(name, url, fmt::format("more than {} bytes (--max-body-bytes)", max_bytes_));
      bad_url(name, url, fmt::format("could not fetch it: {}", *error ? error : curl_easy_strerror(rc)));
    }
    long code = 0;
    curl_easy_getinfo(e.h, CURLINFO_RESPONSE_CODE, &code);
    if (code >= 200 && code < 300) return std::move(sink.bytes);
    char* next = nullptr;
    curl_easy_getinfo(e.h, CURLINFO_REDIRECT_URL, &next);
    if (code < 300 || code >= 400 || !next) bad_url(name, url, fmt::format("the server answered HTTP {}", code));
    if (hop == kMaxRedirects) bad_url(name, first, fmt::format("more than {} redirects", kMaxRedirects));
    budget.release(int64_t(sink.bytes.size()));  // a redirect's body is dropped
    held -= int64_t(sink.bytes.size());
    url = next;
  }
  if (Clock::now() >= deadline) reject(504, "timeout", fmt::format("{}: {}: not fetched before the request's deadline (--request-timeout)", name, shown(first)));
  bad_url(name, first, fmt::format("not fetched within {} s (--media-fetch-timeout)", timeout_s_));
}

#else

bool http_media_supported() { return false; }

std::vector<uint8_t> MediaSources::fetch(const std::string& url, const std::string& name, Clock::time_point,
                                         ByteBudget&, int64_t&) const {
  bad_url(name, url, "this build of fovea cannot fetch http(s) URLs (built without libcurl)");
}

#endif

}  // namespace fovea::server
