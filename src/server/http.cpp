// The HTTP/1.1 layer of `fovea serve` (see http.h): Asio's event loop on one thread, Beast's request
// parser, a pool of worker threads for request bodies.
#include "server/http.h"

#include <signal.h>
#include <sys/resource.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <unordered_set>

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/thread_pool.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/http/error.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/string_body.hpp>
#include <fmt/format.h>

#include "fovea/error.h"
#include "fovea/threads.h"

namespace fovea::server::http {

namespace asio = boost::asio;
namespace bhttp = boost::beast::http;
using tcp = asio::ip::tcp;

namespace {

bool iequals(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) == std::tolower(static_cast<unsigned char>(y));
         });
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

// RFC 9110 tchar.
bool is_tchar(unsigned char c) {
  if (std::isalnum(c)) return true;
  return std::string_view("!#$%&'*+-.^_`|~").find(char(c)) != std::string_view::npos;
}

const char* reason(int status) {
  switch (status) {
    case 100: return "Continue";
    case 200: return "OK";
    case 400: return "Bad Request";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 413: return "Content Too Large";
    case 415: return "Unsupported Media Type";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 503: return "Service Unavailable";
    case 504: return "Gateway Timeout";
    default: return "Unknown";
  }
}

// A reply's status line and fields; the body is the second buffer of the same gathered write (never copied).
std::string serialize_head(const Response& r, bool keep_alive) {
  std::string out =
      fmt::format("HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: {}\r\n", r.status,
                  reason(r.status), r.content_type, r.body.size(), keep_alive ? "keep-alive" : "close");
  for (const auto& h : r.headers) out += fmt::format("{}: {}\r\n", h.name, h.value);
  out += "\r\n";
  return out;
}

// Names a worker thread once, for debuggers and top, and lowers its priority below the network
// thread's (kBulkNice): decoding never keeps /health or a reply's write waiting for a core.
void name_worker() {
  static thread_local const bool named =
      (name_this_thread("fovea-worker"), lower_this_thread_priority(kBulkNice), true);
  (void)named;
}

}  // namespace

std::string_view Request::header(std::string_view name) const {
  for (const auto& h : headers)
    if (iequals(h.name, name)) return h.value;
  return {};
}

HeadCheck check_head(std::string_view head, size_t max_fields) {
  if (!head.ends_with("\r\n\r\n")) return {400, "the head does not end with an empty line"};
  for (size_t i = 0; i < head.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(head[i]);
    if (c == '\r') {
      if (i + 1 >= head.size() || head[i + 1] != '\n') return {400, "a CR not followed by LF"};
    } else if (c == '\n') {
      if (i == 0 || head[i - 1] != '\r') return {400, "a line ending in a bare LF"};
    } else if (c == 0) {
      return {400, "a NUL byte in the head"};
    } else if ((c < 0x20 && c != '\t') || c == 0x7F) {
      return {400, fmt::format("control byte 0x{:02X} in the head", c)};
    }
  }
  std::string_view rest = head.substr(0, head.size() - 2);  // every line below ends with CRLF
  auto next_line = [&rest] {
    const size_t e = rest.find("\r\n");
    const std::string_view line = rest.substr(0, e);
    rest.remove_prefix(e + 2);
    return line;
  };
  const std::string_view request_line = next_line();
  const size_t sp1 = request_line.find(' ');
  const size_t sp2 = sp1 == std::string_view::npos ? sp1 : request_line.find(' ', sp1 + 1);
  if (sp1 == 0 || sp2 == std::string_view::npos || request_line.find(' ', sp2 + 1) != std::string_view::npos)
    return {400, "the request line is not 'METHOD TARGET HTTP/1.x'"};
  for (char c : request_line.substr(0, sp1))
    if (!is_tchar(static_cast<unsigned char>(c))) return {400, "the method is not a token"};
  const std::string_view target = request_line.substr(sp1 + 1, sp2 - sp1 - 1);
  if (target.empty() || target[0] != '/') return {400, "the target is not a path (origin form)"};
  const std::string_view version = request_line.substr(sp2 + 1);
  if (version != "HTTP/1.1" && version != "HTTP/1.0") return {400, "the version is not HTTP/1.1 or HTTP/1.0"};
  size_t fields = 0, content_length = 0, transfer_encoding = 0;
  while (!rest.empty()) {
    const std::string_view line = next_line();
    if (line.empty()) break;
    if (line[0] == ' ' || line[0] == '\t') return {400, "obsolete line folding in the head"};
    if (++fields > max_fields) return {431, fmt::format("more than {} header fields", max_fields)};
    const size_t colon = line.find(':');
    if (colon == 0 || colon == std::string_view::npos) return {400, "a header line without a field name and ':'"};
    const std::string_view name = line.substr(0, colon);
    for (char c : name)
      if (!is_tchar(static_cast<unsigned char>(c))) return {400, "a header field name that is not a token"};
    const std::string_view value = trim(line.substr(colon + 1));
    if (iequals(name, "content-length")) {
      if (++content_length > 1) return {400, "more than one Content-Length"};
      if (value.empty() || value.size() > 18 ||
          !std::all_of(value.begin(), value.end(), [](char c) { return c >= '0' && c <= '9'; }))
        return {400, "Content-Length is not a decimal number"};
    } else if (iequals(name, "transfer-encoding")) {
      if (++transfer_encoding > 1) return {400, "more than one Transfer-Encoding"};
      if (!iequals(value, "chunked")) return {400, "Transfer-Encoding other than 'chunked'"};
    }
  }
  if (content_length && transfer_encoding) return {400, "both Content-Length and Transfer-Encoding"};
  return {0, {}};
}

// ---- the server -------------------------------------------------------------------------------

class Connection;

struct Server::Impl {
  Impl(const Options& o, Handler& h) : opt(o), lim(o.limits), handler(h), pool(size_t(o.threads)) {}

  const Options opt;
  const Limits lim;
  Handler& handler;
  asio::io_context io{1};
  tcp::acceptor acceptor{io};
  asio::signal_set signals{io, SIGINT, SIGTERM};
  asio::steady_timer accept_retry{io};
  asio::thread_pool pool;
  std::unordered_set<std::shared_ptr<Connection>> conns;  // network thread only
  size_t body_bytes_reserved = 0;                         // network thread only
  std::atomic<size_t> in_flight{0};                       // requests being read or handled
  std::atomic<bool> draining{false};
  std::atomic<bool> stopping{false};  // a first signal arrived
  asio::steady_timer drain_delay{io};
  asio::steady_timer drain_deadline{io};  // --shutdown-timeout, from the drain's start
  int signal_number = 0;
  int port = 0;

  void accept();
  void start(tcp::socket s);
  void drain();
  void maybe_finish() {
    if (!draining || !conns.empty()) return;
    drain_deadline.cancel();
    io.stop();
  }
};

class Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(Server::Impl& s, tcp::socket sock) : s_(s), sock_(std::move(sock)), timer_(s.io) {}

  void start() {
    boost::system::error_code ec;
    sock_.set_option(tcp::no_delay(true), ec);
    advance();
  }

  // Shutdown began: requests still arriving get 503; idle connections get a grace period in which a
  // request that was already on its way is answered (503), then they are closed.
  void on_drain() {
    switch (state_) {
      case State::IDLE:
      case State::HEAD:
        arm(std::min(s_.lim.shutdown_grace_s, state_ == State::HEAD ? s_.lim.header_timeout_s : 1e9));
        break;
      case State::BODY:
        fail(503, "shutting_down", "the server is shutting down; this request's body had not been read; retry");
        break;
      default: break;  // being handled or written: its reply goes out, then the connection closes
    }
  }

  // Shutdown's timeout passed: a request still being handled is answered 503 now (its handler's
  // reply, when it comes, is dropped).
  void on_drain_timeout() {
    if (state_ != State::WORK) return;
    fail(503, "shutting_down",
         fmt::format("the server is shutting down and this request did not finish within {} s "
                     "(--shutdown-timeout); retry",
                     s_.lim.shutdown_timeout_s));
  }

 private:
  enum class State { IDLE, HEAD, BODY, WORK, WRITE, LINGER, CLOSED };

  // ---- reading --------------------------------------------------------------------------------
  void read() {
    if (reading_ || state_ == State::CLOSED) return;
    reading_ = true;
    sock_.async_read_some(asio::buffer(chunk_), [self = shared_from_this()](boost::system::error_code ec, size_t n) {
      self->reading_ = false;
      self->on_read(ec, n);
    });
  }

  void on_read(boost::system::error_code ec, size_t n) {
    if (state_ == State::CLOSED) return;
    if (state_ == State::LINGER) {  // discarding what the client still sends after our last reply
      if (ec)
        close();
      else
        read();
      return;
    }
    if (ec) {                        // EOF or reset
      if (state_ == State::WRITE) {  // a reply is going out (a 408, say): let it finish, then close
        keep_alive_ = false;
        return;
      }
      close();
      return;
    }
    in_.append(chunk_.data(), n);
    advance();
  }

  // Moves the connection as far as the buffered bytes allow.
  void advance() {
    for (;;) {
      switch (state_) {
        case State::IDLE:
          if (in_.empty()) {
            arm(s_.draining ? s_.lim.shutdown_grace_s : s_.lim.keep_alive_timeout_s);
            read();
            return;
          }
          state_ = State::HEAD;
          scanned_ = 0;
          arm(s_.draining ? std::min(s_.lim.shutdown_grace_s, s_.lim.header_timeout_s) : s_.lim.header_timeout_s);
          break;
        case State::HEAD:
          if (!on_head()) return;
          break;
        case State::BODY:
          if (!on_body()) return;
          break;
        default: return;
      }
    }
  }

  // true: the head was read and the connection moved on; false: wait (or it was answered).
  bool on_head() {
    const size_t from = scanned_ > 3 ? scanned_ - 3 : 0;
    const size_t end = in_.find("\r\n\r\n", from);
    if (end == std::string::npos) {
      scanned_ = in_.size();
      if (in_.size() > s_.lim.max_header_bytes) {
        fail(431, "header_too_large", fmt::format("the request head exceeds {} bytes", s_.lim.max_header_bytes));
        return false;
      }
      read();
      return false;
    }
    const size_t head_bytes = end + 4;
    if (head_bytes > s_.lim.max_header_bytes) {
      fail(431, "header_too_large", fmt::format("the request head exceeds {} bytes", s_.lim.max_header_bytes));
      return false;
    }
    const std::string_view head(in_.data(), head_bytes);
    if (const HeadCheck c = check_head(head, s_.lim.max_header_fields); c.status != 0) {
      fail(c.status, c.status == 431 ? "too_many_headers" : "bad_request", "malformed HTTP request: " + c.problem);
      return false;
    }
    {  // the path first, so that a reply refused from the head is counted under it
      const std::string_view line = head.substr(0, head.find("\r\n"));
      const size_t a = line.find(' ') + 1, b = line.find(' ', a);
      const std::string_view target = line.substr(a, b - a);
      req_ = Request{};
      req_.path = std::string(target.substr(0, target.find('?')));
    }
    parser_.emplace();
    parser_->header_limit(std::uint32_t(s_.lim.max_header_bytes + 1));
    parser_->body_limit(s_.lim.max_body_bytes);
    parser_->eager(true);
    boost::system::error_code ec;
    parser_->put(asio::buffer(head.data(), head.size()), ec);
    if (ec == bhttp::error::body_limit) {
      body_too_large();
      return false;
    }
    if ((ec && ec != bhttp::error::need_more) || !parser_->is_header_done()) {
      fail(400, "bad_request", "malformed HTTP request: " + (ec ? ec.message() : std::string("incomplete head")));
      return false;
    }
    const auto& msg = parser_->get();
    req_ = Request{};
    req_.method = std::string(msg.method_string());
    req_.target = std::string(msg.target());
    req_.path = req_.target.substr(0, req_.target.find('?'));
    req_.version = msg.version() == 10 ? 10 : 11;
    for (const auto& f : msg) req_.headers.push_back({std::string(f.name_string()), std::string(f.value())});
    req_.received = Clock::now();
    keep_alive_ = parser_->keep_alive();
    in_.erase(0, head_bytes);

    if (s_.draining) {
      fail(503, "shutting_down", "the server is shutting down; retry on another instance");
      return false;
    }
    const bool has_body = !parser_->is_done();
    if (std::optional<Response> now = s_.handler.route(req_)) {
      if (has_body) keep_alive_ = false;  // its body is not read: the connection cannot carry on
      respond(std::move(*now));
      return false;
    }
    if (const auto length = parser_->content_length(); length && *length > s_.lim.max_body_bytes) {
      body_too_large();
      return false;
    }
    if (!reserve(parser_->content_length().value_or(has_body ? std::min<size_t>(s_.lim.max_body_bytes, 1 << 20) : 0)))
      return false;
    if (has_body && iequals(req_.header("expect"), "100-continue")) send("HTTP/1.1 100 Continue\r\n\r\n", {}, false);
    state_ = State::BODY;
    arm(s_.lim.body_timeout_s);
    return true;
  }

  // Body bytes budget across connections; false (and a 503) when it cannot be had. A lone request
  // always fits: the budget only bounds concurrency.
  bool reserve(size_t total) {
    if (total <= reserved_) return true;
    const size_t more = total - reserved_;
    if (s_.body_bytes_reserved > reserved_ && s_.body_bytes_reserved + more > s_.lim.max_body_bytes_in_flight) {
      fail(503, "server_busy",
           fmt::format("request bodies being received take {} bytes; this one would pass the server's limit of {}; "
                       "retry later",
                       s_.body_bytes_reserved, s_.lim.max_body_bytes_in_flight),
           true);
      return false;
    }
    s_.body_bytes_reserved += more;
    reserved_ = total;
    return true;
  }
  void unreserve() {
    s_.body_bytes_reserved -= reserved_;
    reserved_ = 0;
  }

  bool on_body() {
    if (!parser_->is_done() && !in_.empty()) {
      boost::system::error_code ec;
      const size_t used = parser_->put(asio::buffer(in_.data(), in_.size()), ec);
      in_.erase(0, used);
      if (ec == bhttp::error::body_limit) {
        body_too_large();
        return false;
      }
      if (ec && ec != bhttp::error::need_more) {
        fail(400, "bad_request", "malformed HTTP request body: " + ec.message());
        return false;
      }
      // Chunked bodies reserve as they grow (doubling, up to the limit).
      const size_t got = parser_->get().body().size();
      if (got > reserved_ && !reserve(std::min(s_.lim.max_body_bytes, std::max(got, 2 * reserved_)))) return false;
    }
    if (!parser_->is_done()) {
      read();
      return false;
    }
    req_.body = std::move(parser_->get().body());
    req_.body_read = Clock::now();
    parser_.reset();
    state_ = State::WORK;
    s_.in_flight += 1;  // a request is in flight from its complete body to its reply
    counted_ = true;
    disarm();
    asio::post(s_.pool, [self = shared_from_this(), this] {
      name_worker();
      req_.handling = Clock::now();
      auto replied = std::make_shared<std::atomic<bool>>(false);
      const Handler::Reply reply = [self, replied](Response r) {
        if (replied->exchange(true)) return;  // once
        asio::post(self->s_.io, [self, r = std::move(r)]() mutable {
          if (self->state_ != State::WORK) return;  // answered already (shutdown's timeout)
          self->req_.body = std::string();
          self->respond(std::move(r));
        });
      };
      try {
        s_.handler.handle(req_, reply);
      } catch (const std::exception& e) {
        reply(s_.handler.error(500, "internal_error", e.what()));
      } catch (...) {
        reply(s_.handler.error(500, "internal_error", "unknown exception"));
      }
    });
    return false;
  }

  // ---- writing --------------------------------------------------------------------------------
  // An error the layer answers itself; the connection closes after it.
  void body_too_large() {
    fail(413, "body_too_large",
         fmt::format("the request body exceeds {} bytes (--max-body-bytes)", s_.lim.max_body_bytes));
  }
  void fail(int status, const std::string& code, const std::string& message, bool retry_after = false) {
    keep_alive_ = false;
    Response r = s_.handler.error(status, code, message);
    if (retry_after || status == 503) r.headers.push_back({"Retry-After", "1"});
    respond(std::move(r));
  }

  void respond(Response r) {
    if (state_ == State::CLOSED) return;
    parser_.reset();
    unreserve();
    if (s_.draining) keep_alive_ = false;
    std::string head = serialize_head(r, keep_alive_);
    state_ = State::WRITE;
    status_ = r.status;
    req_.ready = Clock::now();
    arm(s_.lim.write_timeout_s);
    send(std::move(head), std::move(r.body), true);
  }

  // Writes are queued (a 100 Continue may still be going out when the reply is ready).
  void send(std::string head, std::string body, bool is_reply) {
    outq_.push_back({std::move(head), std::move(body), is_reply});
    if (outq_.size() == 1) write_next();
  }
  void write_next() {
    const Out& o = outq_.front();
    asio::async_write(sock_, std::array<asio::const_buffer, 2>{asio::buffer(o.head), asio::buffer(o.body)},
                      [self = shared_from_this()](boost::system::error_code ec, size_t) { self->on_written(ec); });
  }
  void on_written(boost::system::error_code ec) {
    if (state_ == State::CLOSED) return;
    const bool was_reply = outq_.front().is_reply;
    outq_.pop_front();
    if (ec) {
      close();
      return;
    }
    if (!outq_.empty()) {
      write_next();
      return;
    }
    if (!was_reply) return;  // the 100 Continue
    s_.handler.replied(req_, status_);
    if (counted_) {
      s_.in_flight -= 1;
      counted_ = false;
    }
    req_ = Request{};
    if (!keep_alive_) {
      linger();
      return;
    }
    state_ = State::IDLE;
    advance();  // a pipelined request may be waiting in the buffer
  }

  // Half-close, then read and discard for a moment, so that the client reads the reply instead of
  // a reset caused by its unread bytes.
  void linger() {
    state_ = State::LINGER;
    boost::system::error_code ec;
    sock_.shutdown(tcp::socket::shutdown_send, ec);
    in_.clear();
    arm(2.0);
    read();
  }

  void close() {
    if (state_ == State::CLOSED) return;
    state_ = State::CLOSED;
    if (counted_) {
      s_.in_flight -= 1;
      counted_ = false;
    }
    unreserve();
    disarm();
    boost::system::error_code ec;
    sock_.close(ec);
    s_.conns.erase(shared_from_this());
    s_.maybe_finish();
  }

  // ---- deadlines ------------------------------------------------------------------------------
  void arm(double secs) {
    const uint64_t gen = ++timer_gen_;
    timer_.expires_after(from_seconds(secs));
    timer_.async_wait([self = shared_from_this(), gen](boost::system::error_code ec) {
      if (!ec && gen == self->timer_gen_) self->on_timeout();
    });
  }
  void disarm() {
    ++timer_gen_;
    timer_.cancel();
  }
  void on_timeout() {
    switch (state_) {
      case State::IDLE:
        close();  // idle between requests: closing is what keep-alive means
        break;
      case State::HEAD:
        if (s_.draining)
          fail(503, "shutting_down", "the server is shutting down; retry on another instance");
        else
          fail(408, "request_timeout",
               fmt::format("the request head did not arrive within {} s", s_.lim.header_timeout_s));
        break;
      case State::BODY:
        fail(408, "request_timeout", fmt::format("the request body did not arrive within {} s", s_.lim.body_timeout_s));
        break;
      case State::WORK: break;
      case State::WRITE:
      case State::LINGER:
        close();  // the client does not read its reply, or lingering is over
        break;
      case State::CLOSED: break;
    }
  }

  struct Out {
    std::string head, body;
    bool is_reply;
  };

  Server::Impl& s_;
  tcp::socket sock_;
  asio::steady_timer timer_;
  uint64_t timer_gen_ = 0;
  State state_ = State::IDLE;
  // Where a read lands, never zeroed: a connection's pages are touched only by the bytes it receives.
  // Zeroing 64 KiB per accepted connection (a fresh page fault per 4 KiB) kept the network thread
  // ~0.7 ms on each one, so a burst of 160 connections delayed a /health behind it by 120 ms.
  std::array<char, 64 << 10> chunk_;
  bool reading_ = false;
  std::string in_;      // bytes read and not yet consumed
  size_t scanned_ = 0;  // bytes of in_ already searched for the end of the head
  std::optional<bhttp::request_parser<bhttp::string_body>> parser_;
  Request req_;
  bool keep_alive_ = true;
  bool counted_ = false;  // counted in in_flight
  int status_ = 0;
  size_t reserved_ = 0;  // body bytes reserved from the server's budget
  std::deque<Out> outq_;
};

void Server::Impl::start(tcp::socket s) {
  if (conns.size() >= lim.max_connections) {
    // Best effort, never blocking: a fresh socket's send buffer takes this short reply.
    Response r =
        handler.error(503, "too_many_connections",
                      fmt::format("the server has {} open connections (its limit); retry later", conns.size()));
    r.headers.push_back({"Retry-After", "1"});
    const std::string head = serialize_head(r, false);
    boost::system::error_code ec;
    s.non_blocking(true, ec);
    asio::write(s, std::array<asio::const_buffer, 2>{asio::buffer(head), asio::buffer(r.body)}, ec);
    s.shutdown(tcp::socket::shutdown_send, ec);
    s.close(ec);
    handler.replied(Request{}, 503);
    return;
  }
  auto c = std::make_shared<Connection>(*this, std::move(s));
  conns.insert(c);
  c->start();
}

void Server::Impl::accept() {
  acceptor.async_accept([this](boost::system::error_code ec, tcp::socket s) {
    if (!acceptor.is_open()) return;
    if (ec) {  // out of file descriptors, say: try again shortly instead of spinning
      accept_retry.expires_after(std::chrono::milliseconds(50));
      accept_retry.async_wait([this](boost::system::error_code e) {
        if (!e && acceptor.is_open()) accept();
      });
      return;
    }
    start(std::move(s));
    accept();
  });
}

void Server::Impl::drain() {
  draining = true;
  // Connections the kernel accepted already (the backlog) are taken in, so that their requests are
  // answered (503) rather than reset when the listening socket closes.
  boost::system::error_code ec;
  acceptor.non_blocking(true, ec);
  for (;;) {
    tcp::socket s(io);
    acceptor.accept(s, ec);
    if (ec) break;
    start(std::move(s));
  }
  acceptor.close(ec);
  accept_retry.cancel();
  const std::vector<std::shared_ptr<Connection>> all(conns.begin(), conns.end());
  for (const auto& c : all) c->on_drain();
  drain_deadline.expires_after(from_seconds(lim.shutdown_timeout_s));
  drain_deadline.async_wait([this](boost::system::error_code e) {
    if (e) return;
    const std::vector<std::shared_ptr<Connection>> left(conns.begin(), conns.end());
    for (const auto& c : left) c->on_drain_timeout();
    handler.abandon();
  });
  maybe_finish();
}

Server::Server(const Options& o, Handler& handler) : impl_(std::make_unique<Impl>(o, handler)) {
  Impl& s = *impl_;
  // Every connection is a file descriptor: raise the soft limit to the hard one.
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
  }
  boost::system::error_code ec;
  const auto address = asio::ip::make_address(o.host, ec);
  if (ec) fail("--host {}: not an IP address ({})", o.host, ec.message());
  const tcp::endpoint ep(address, static_cast<unsigned short>(o.port));
  s.acceptor.open(ep.protocol(), ec);
  if (!ec) s.acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) s.acceptor.bind(ep, ec);
  if (!ec) s.acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) fail("cannot listen on {}:{}: {}", o.host, o.port, ec.message());
  s.port = s.acceptor.local_endpoint().port();
}

Server::~Server() { impl_->pool.join(); }

int Server::port() const { return impl_->port; }
size_t Server::in_flight() const { return impl_->in_flight; }

void Server::post(std::function<void()> fn) {
  asio::post(impl_->pool, [fn = std::move(fn)] {
    name_worker();
    fn();
  });
}
bool Server::draining() const { return impl_->draining; }
bool Server::stopping() const { return impl_->stopping; }

int Server::run(const std::function<void(int, size_t)>& on_signal) {
  Impl& s = *impl_;
  s.signals.async_wait([&s, &on_signal](boost::system::error_code ec, int sig) {
    if (ec) return;
    s.signal_number = sig;
    on_signal(sig, s.in_flight);
    s.signals.async_wait([](boost::system::error_code e, int) {
      if (e) return;
      std::fprintf(stderr, "fovea serve: second signal: exiting without finishing\n");
      std::fflush(stderr);
      std::_Exit(1);
    });
    s.stopping = true;
    if (s.lim.drain_delay_s <= 0) return s.drain();
    // Serve on while the balancers' probes see /ready at 503 and stop sending here.
    s.drain_delay.expires_after(from_seconds(s.lim.drain_delay_s));
    s.drain_delay.async_wait([&s](boost::system::error_code e) {
      if (!e) s.drain();
    });
  });
  s.accept();
  s.io.run();
  // The loop stopped after the drain: every connection is closed and every reply written. The second
  // signal handler is still registered with the signal set until here.
  s.pool.join();
  return s.signal_number;
}

}  // namespace fovea::server::http
