// The endpoints of `fovea serve`, written once: the router's 404 and 405 answers and the metrics'
// path label read them.
#pragma once
#include <array>
#include <map>
#include <string>
#include <string_view>

namespace fovea::server {

struct Endpoint {
  std::string_view method, path;
};

inline constexpr std::array<Endpoint, 6> kEndpoints = {{
    {"POST", "/v1/encode"},
    {"POST", "/v1/chat/completions"},
    {"GET", "/health"},
    {"GET", "/ready"},
    {"GET", "/v1/models"},
    {"GET", "/metrics"},
}};

// Path -> the one method it takes.
inline std::map<std::string, std::string> endpoint_methods() {
  std::map<std::string, std::string> out;
  for (const Endpoint& e : kEndpoints) out.emplace(e.path, e.method);
  return out;
}

// "POST /v1/encode, GET /health, ...", for messages.
inline std::string endpoint_list() {
  std::string out;
  for (const Endpoint& e : kEndpoints) {
    if (!out.empty()) out += ", ";
    out.append(e.method).append(" ").append(e.path);
  }
  return out;
}

}  // namespace fovea::server
