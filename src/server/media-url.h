// Items given by URL instead of inline, as vLLM's encode instance takes them, opt-in and bounded:
//   file://PATH    read only below --allowed-local-media-path: the path is opened beneath that folder
//                  by the kernel (openat2 RESOLVE_BENEATH), so neither ".." nor a symlink leads out;
//                  relative symlinks that stay inside are followed, absolute ones never
//   http(s)://...  fetched (libcurl) only from the hosts of --allowed-media-domains ("*": any);
//                  every redirect (at most kMaxRedirects) is checked again; loopback and private
//                  addresses only with --allow-private-media-urls, link-local ones (cloud metadata
//                  services live there) never; no transparent decompression
// Every item is capped at --max-body-bytes (what an upload of it could be), its fetch at
// --media-fetch-timeout and the request's deadline, and the bytes it holds count against the server's
// bytes of request bodies in flight (--max-body-bytes-in-flight) until the request ends, taken as they
// arrive and never waited for. Once read, an item is decoded like an uploaded one, within the decode
// budget.
//
// http(s) fetches run apart from the request workers, on one thread that drives every transfer
// (libcurl's multi interface: DNS, connects and reads never block it), at most kFetchesPerHost
// connections to one host and kFetchesAtOnce in all (more wait their turn, within their deadlines):
// a request whose origin stalls holds no worker, and delays no request but its own. A fetch's buffer
// counts in the budget by its capacity (a Content-Length's bytes up front, else doubling room), so
// what the budget says is what the allocator holds.
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fovea/clock.h"
#include "fovea/io.h"
#include "fovea/serve.h"
#include "server/budget.h"
#include "server/request.h"

struct sockaddr;

namespace fovea::server {

inline constexpr int kMaxRedirects = 5;
inline constexpr int kFetchesPerHost = 8, kFetchesAtOnce = 256;

// What a fetch gives its caller: the bytes (`held` of the budget is theirs to give back), or the
// error its request fails with.
struct Fetched {
  std::vector<uint8_t> bytes;
  int64_t held = 0;
  std::optional<ApiError> error;
};
using FetchDone = std::function<void(Fetched)>;
class Fetcher;  // media-url.cpp: the fetching thread

// Why fovea will not connect to this address ("" if it may): link-local (cloud metadata services
// answer there), site-local, unspecified, multicast and broadcast never; loopback and private (RFC
// 1918, carrier-grade NAT, unique local) only if private_ok. An IPv6 address that stands for an IPv4
// one (mapped, compatible, translated, NAT64 well-known and local-use, 6to4, Teredo, ISATAP) is
// judged by the IPv4 rules too.
std::string address_problem(const sockaddr* sa, bool private_ok);

// What URL items may read, from the options; built once at start-up (opens the local folder).
// Throws fovea::Error for a folder that cannot be opened, or --allowed-media-domains in a build
// without libcurl.
class MediaSources {
 public:
  explicit MediaSources(const ServeOptions& o);
  ~MediaSources();
  MediaSources(const MediaSources&) = delete;
  MediaSources& operator=(const MediaSources&) = delete;

  // Whether `url` is fetched over the network (http:// or https://, any case): fetch(), not read().
  static bool is_http(const std::string& url);
  // The bytes at a file:// URL (or the error for a scheme fovea does not read), at most --max-body-bytes,
  // for item `name`, read on the calling thread. Room for them is taken from `budget` (`held` adds what
  // was taken; the caller gives it back). Throws ApiError: 400 invalid_url naming the item and the URL
  // (a scheme or place not allowed, not found, too large), 503 server_busy (no room in the budget).
  std::vector<uint8_t> read(const std::string& url, const std::string& name, ByteBudget& budget, int64_t& held) const;
  // Starts fetching an http(s) URL on the fetching thread and returns; `done` is called there once,
  // with the bytes or the error (400 invalid_url: not allowed, an HTTP error status, too large, a
  // failed connection or TLS check, --media-fetch-timeout; 503 server_busy: no room in the budget;
  // 504 timeout: past `deadline`), and must only hand it on. What is refused before anything starts
  // (no --allowed-media-domains) is thrown here. Once `cancel` (if given) is set, the fetch ends
  // within a fraction of a second (a request whose other item failed needs it no more).
  void fetch(const std::string& url, const std::string& name, Clock::time_point deadline, ByteBudget& budget,
             FetchDone done, std::shared_ptr<const std::atomic<bool>> cancel = nullptr) const;
  // Ends every fetch running now with `why` (shutdown's grace ran out).
  void abort_fetches(const ApiError& why) const;

  // One line for the start-up log: what URLs this server reads.
  std::string describe() const;

 private:
  friend class Fetcher;
  bool domain_allowed(const std::string& host) const;

  std::string local_root_;            // as given; "" = file:// refused
  std::string local_real_;            // its canonical path
  Fd local_fd_;                       // open on local_real_ (O_PATH), or none
  std::vector<std::string> domains_;  // lower case; empty = http(s) refused
  bool any_domain_ = false, private_ok_ = false;
  double timeout_s_ = 30;
  int64_t max_bytes_ = 0;
  std::unique_ptr<Fetcher> fetcher_;  // with --allowed-media-domains
};

}  // namespace fovea::server
