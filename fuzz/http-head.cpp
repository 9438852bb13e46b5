// Fuzzes the HTTP layer's strict head check and, for heads it accepts, Beast's parse of them, as the
// server chains them (src/server/http.cpp): neither may crash, and a head check_head accepts must
// end with the blank line.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/string_body.hpp>

#include "server/http.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const auto check = fovea::server::http::check_head(text, 100);
  if (check.status != 0) {
    if (check.problem.empty()) std::abort();  // a refusal always says why
    return 0;
  }
  if (!text.ends_with("\r\n\r\n")) std::abort();
  boost::beast::http::request_parser<boost::beast::http::string_body> p;
  p.header_limit(16 << 10);
  p.body_limit(1 << 20);
  p.eager(true);
  boost::beast::error_code ec;
  p.put(boost::asio::buffer(text.data(), text.size()), ec);
  return 0;
}
