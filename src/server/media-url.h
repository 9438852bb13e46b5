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
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "fovea/clock.h"
#include "fovea/serve.h"
#include "server/budget.h"

namespace fovea::server {

inline constexpr int kMaxRedirects = 5;

// What URL items may read, from the options; built once at start-up (opens the local folder).
// Throws fovea::Error for a folder that cannot be opened, or --allowed-media-domains in a build
// without libcurl.
class MediaSources {
 public:
  explicit MediaSources(const ServeOptions& o);
  ~MediaSources();
  MediaSources(const MediaSources&) = delete;
  MediaSources& operator=(const MediaSources&) = delete;

  // The bytes at `url` (file://, http:// or https://), at most max_bytes, for item `name`. Room for
  // them is taken from `budget` as they arrive (`held` adds what was taken; the caller gives it back).
  // Throws ApiError: 400 invalid_url naming the item and the URL (a scheme or place not allowed, not
  // found, an HTTP error status, too large, a failed connection or TLS check), 503 server_busy (no
  // room in the budget), 504 timeout (past the request's deadline).
  std::vector<uint8_t> read(const std::string& url, const std::string& name, Clock::time_point deadline,
                            ByteBudget& budget, int64_t& held) const;

  // One line for the start-up log: what URLs this server reads.
  std::string describe() const;

 private:
  std::vector<uint8_t> read_file(const std::string& url, const std::string& name, ByteBudget& budget,
                                 int64_t& held) const;
  std::vector<uint8_t> fetch(const std::string& url, const std::string& name, Clock::time_point deadline,
                             ByteBudget& budget, int64_t& held) const;
  bool domain_allowed(const std::string& host) const;

  std::string local_root_;  // as given; "" = file:// refused
  std::string local_real_;  // its canonical path
  int local_fd_ = -1;
  std::vector<std::string> domains_;  // lower case; empty = http(s) refused
  bool any_domain_ = false, private_ok_ = false;
  double timeout_s_ = 30;
  int64_t max_bytes_ = 0;
};

}  // namespace fovea::server
