// The HTTP/1.1 layer of `fovea serve`: one network thread (Boost.Asio) owns every connection and
// never blocks, so no client, however slow or idle, holds anything but a socket and its buffers;
// request bodies are handled on a pool of worker threads; Boost.Beast's parser reads heads and
// bodies (chunked included) after a strict check of the raw head of our own (check_head).
//
// Why Asio + Beast (Debian's libboost-dev, header-only, so the binary needs no Boost library on the
// GPU machine): cpp-httplib 0.11 gave every connection a thread (32) and had no deadline per request,
// so 64 clients sending a byte a second, or 200 idle connections, starved /health for 20-30 s.
// Here a connection costs no thread, every phase has a deadline (head, body, keep-alive idle,
// writing the reply), and /health is answered on the network thread, independent of encode load.
// libmicrohttpd was the other candidate; Beast was picked for its strict, fuzzed parser (duplicate
// conflicting Content-Length, Content-Length with chunked) and for keeping the reply path in C++.
//
// Per connection: requests are read one at a time and answered in order (pipelined requests wait
// in the buffer; the socket is not read while a request is being handled, so a client that
// half-closes after its request still gets the reply). Replies the layer makes itself:
//   400 malformed head or body (check_head, Beast's parser), 408 head or body deadline passed,
//   413 body over max_body_bytes, 431 head over max_header_bytes or max_header_fields,
//   503 connection limit, body-bytes budget, or shutting down (each closes the connection).
// Shutdown (SIGINT/SIGTERM): first, for limits.drain_delay_s, go on serving while stopping() is
// true (the service's readiness probe says 503, so a load balancer stops sending); then stop accepting (connections
// already in the kernel's backlog are taken first), answer every request whose body was fully read (within
// limits.shutdown_timeout_s: then those still being handled get 503 at once and Handler::abandon() is called), answer
// 503 to every request whose head or body was still arriving and to any that arrives within a grace period, then
// return. A second signal exits at once (code 1).
#pragma once
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "fovea/clock.h"
#include "fovea/serve.h"

namespace fovea::server::http {

using Limits = HttpLimits;  // fovea/serve.h: they are serve's flags

// How much lower the priority of threads doing bulk work (the workers, the encoder replicas, the
// fetching thread) is than the network thread's, in nice steps.
inline constexpr int kBulkNice = 5;

struct Header {
  std::string name, value;
};

struct Request {
  std::string method, target;  // target as sent (origin form)
  std::string path;            // target without its query
  int version = 11;            // 10 or 11
  std::vector<Header> headers;
  std::string body;
  // When its head was read, its body was read, handle() began, and its reply was ready to write
  // (the last three stay unset for a request answered from its head).
  Clock::time_point received, body_read, handling, ready;
  // The first field of that name (case-insensitive), or "".
  std::string_view header(std::string_view name) const;
};

struct Response {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  std::vector<Header> headers;  // extra fields (Retry-After, Allow)
};

// Strict checks of a request's raw head (request line and fields, through the blank line) that a
// lenient parser would let through: CRLF line ends only, no NUL or other control bytes, no obs-fold,
// field names that are tokens, at most max_fields fields, at most one Content-Length (digits only)
// and one Transfer-Encoding (exactly "chunked"), never both. status 0 when fine, else the reply's
// status (400, or 431 for too many fields) and the problem.
struct HeadCheck {
  int status = 0;
  std::string problem;
};
HeadCheck check_head(std::string_view head, size_t max_fields);

// What the layer calls. route() and error() run on the network thread and must be quick; handle()
// runs on a worker thread.
class Handler {
 public:
  virtual ~Handler() = default;
  // Once a head is read: the reply now (GET endpoints, a request refused from its head), or
  // nullopt to read the body and pass the request to handle().
  virtual std::optional<Response> route(const Request& head) = 0;
  // A request with its body, handled on a worker thread; its reply goes to `reply`, exactly once,
  // from any thread: now, or later from elsewhere (a handler that must wait for something other than
  // the CPU, such as a URL fetch, hands the request on and frees the worker). `request` stays valid
  // until the reply is given; its body is the handler's. An exception thrown before `reply` is called
  // becomes a 500 reply.
  using Reply = std::function<void(Response)>;
  virtual void handle(Request& request, Reply reply) = 0;
  // Called on the network thread when shutdown's timeout (limits.shutdown_timeout_s) has passed and
  // the layer has answered 503 to every request still being handled: whatever those wait for should
  // stop waiting, so the workers come back (their replies are dropped).
  virtual void abandon() = 0;
  // The reply the layer sends for its own errors (400, 408, 413, 431, 503, 500).
  virtual Response error(int status, const std::string& code, const std::string& message) = 0;
  // After each reply was written (the request's path is "" when its request line never parsed).
  virtual void replied(const Request& request, int status) = 0;
};

struct Options {
  std::string host = "127.0.0.1";
  int port = 8000;   // 0: any free port
  int threads = 32;  // worker threads for handle()
  Limits limits;
};

class Server {
 public:
  Server(const Options& options, Handler& handler);  // binds and listens; throws fovea::Error
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  int port() const;
  // Serves until SIGINT or SIGTERM, then drains as described above and returns the signal number.
  // on_signal is called (on the network thread) when the first signal arrives.
  int run(const std::function<void(int signal, size_t in_flight)>& on_signal);
  // Requests read whole and not yet answered (for /metrics and the shutdown message).
  size_t in_flight() const;
  // Runs fn on a worker thread (a handler's request coming back from elsewhere).
  void post(std::function<void()> fn);
  bool draining() const;
  // A first signal arrived: the server is going away (serving still during the drain delay).
  bool stopping() const;

  struct Impl;  // http.cpp: the event loop, the acceptor, the connections

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace fovea::server::http
