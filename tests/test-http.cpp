// The server's input layers without a socket: the strict head check of the HTTP layer and the
// /v1/encode body parser, on the request-smuggling and hostile-JSON classes they must refuse.
#include <gtest/gtest.h>

#include <random>
#include <string>

#include "server/http.h"
#include "server/request.h"
#include "test-util.h"

namespace {

using fovea::server::ApiError;
using fovea::server::parse_encode_request;
using fovea::server::RequestItem;
using fovea::server::http::check_head;

int status_of(const std::string& head) { return check_head(head, 100).status; }

TEST(HttpHead, AcceptsWellFormedHeads) {
  EXPECT_EQ(status_of("GET /health HTTP/1.1\r\nHost: a\r\n\r\n"), 0);
  EXPECT_EQ(status_of("GET /health?x=1 HTTP/1.0\r\n\r\n"), 0);
  EXPECT_EQ(status_of("POST /v1/encode HTTP/1.1\r\nContent-Length: 10\r\nX-A:\tv\r\n\r\n"), 0);
  EXPECT_EQ(status_of("POST /v1/encode HTTP/1.1\r\nTransfer-Encoding: Chunked\r\n\r\n"), 0);
  EXPECT_EQ(status_of("GET / HTTP/1.1\r\nX: caf\xC3\xA9\r\n\r\n"), 0);  // obs-text in a value
}

TEST(HttpHead, RefusesSmugglingVectors) {
  const std::string cl = "POST / HTTP/1.1\r\nContent-Length: 5\r\n";
  EXPECT_EQ(status_of(cl + "Content-Length: 5\r\n\r\n"), 400);  // duplicate, even when equal
  EXPECT_EQ(status_of(cl + "Transfer-Encoding: chunked\r\n\r\n"), 400);
  EXPECT_EQ(status_of("POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n"), 400);
  EXPECT_EQ(status_of("POST / HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"), 400);
  EXPECT_EQ(status_of("POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n"), 400);
  EXPECT_EQ(status_of("POST / HTTP/1.1\r\nContent-Length: +5\r\n\r\n"), 400);
  EXPECT_EQ(status_of("POST / HTTP/1.1\r\nContent-Length: 5, 5\r\n\r\n"), 400);
  EXPECT_EQ(status_of("POST / HTTP/1.1\r\nContent-Length : 5\r\n\r\n"), 400);  // space before the colon
  EXPECT_EQ(status_of(std::string("GET / HTTP/1.1\r\nX: a\0b\r\n\r\n", 24)), 400);
  EXPECT_EQ(status_of("GET / HTTP/1.1\r\nX: a\r\n b\r\n\r\n"), 400);  // obs-fold
  EXPECT_EQ(status_of("GET / HTTP/1.1\nX: a\r\n\r\n"), 400);          // bare LF
  EXPECT_EQ(status_of("GET / HTTP/1.1\r\nX: a\rb\r\n\r\n"), 400);     // bare CR
  EXPECT_EQ(status_of("GET / HTTP/1.1\r\nX: \x01\r\n\r\n"), 400);
  EXPECT_EQ(status_of("GET  / HTTP/1.1\r\n\r\n"), 400);
  EXPECT_EQ(status_of("GET http://a/ HTTP/1.1\r\n\r\n"), 400);  // absolute form
  EXPECT_EQ(status_of("GET / HTTP/2.0\r\n\r\n"), 400);
  EXPECT_EQ(status_of("G(T / HTTP/1.1\r\n\r\n"), 400);
  EXPECT_EQ(status_of("GET / HTTP/1.1\r\nNoColon\r\n\r\n"), 400);
  const auto c = check_head("GET / HTTP/1.1\r\nX: a\r\n b\r\n\r\n", 100);
  EXPECT_NE(c.problem.find("folding"), std::string::npos) << c.problem;
}

TEST(HttpHead, FieldCountIsBounded) {
  std::string head = "GET / HTTP/1.1\r\n";
  for (int i = 0; i < 100; ++i) head += "X-" + std::to_string(i) + ": v\r\n";
  EXPECT_EQ(status_of(head + "\r\n"), 0);
  EXPECT_EQ(status_of(head + "Y: v\r\n\r\n"), 431);
}

ApiError error_of(const std::string& body, size_t max_images = 16) {
  try {
    parse_encode_request(body, max_images, "synthetic:tiny");
  } catch (const ApiError& e) {
    return e;
  }
  ADD_FAILURE() << "accepted: " << body.substr(0, 200);
  return {};
}

// One field of each of the request's items, in order.
template <typename T>
std::vector<T> items_of(const fovea::server::EncodeRequest& r, T RequestItem::*field) {
  std::vector<T> out;
  for (const RequestItem& it : r.items) out.push_back(it.*field);
  return out;
}

TEST(EncodeRequest, ParsesEveryImageForm) {
  const auto r = parse_encode_request(
      R"({"images": ["data:image/png;base64,QUJD", "REVG", {"type": "image_url", "image_url": {"url": "R0hJ"}},
          {"type": "image_url", "image_url": "data:image/jpeg;base64,SktM"}], "encoding": "float",
          "return_deepstack": true, "model": "synthetic:tiny"})",
      16, "synthetic:tiny");
  ASSERT_EQ(r.items.size(), 4u);
  EXPECT_EQ(r.items[0].payload, "QUJD");
  EXPECT_EQ(r.items[1].payload, "REVG");
  EXPECT_EQ(r.items[2].payload, "R0hJ");
  EXPECT_EQ(r.items[3].payload, "SktM");
  EXPECT_FALSE(r.as_base64);
  EXPECT_TRUE(r.deepstack);
}

// Long strings are lifted out of the body before the JSON parse; the payloads are exactly what a
// plain parse gives, in every image form, next to short and escaped strings; a body holding the
// placeholder's escape \u0000 is parsed whole, so a client's "\u00000" is never taken for image 0;
// invalid JSON around lifted strings is still refused.
TEST(EncodeRequest, LongPayloadsLiftedOutParseAsAPlainParse) {
  std::mt19937 rng(fovea::test::fresh_seed());
  const auto b64 = [&](size_t n) {
    static const char* abc = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    std::string t(n, 'A');
    for (auto& c : t) c = abc[rng() % 64];
    return t;
  };
  const std::string a = b64(5000), b = b64(300000), c = b64(4096), short_one = b64(12);
  const auto r =
      parse_encode_request("{\"images\": [\"data:image/png;base64," + a + "\", \"" + b +
                               "\", {\"type\": \"image_url\", \"image_url\": {\"url\": \"" + c + "\"}}, \"" +
                               short_one + "\", \"data:image/png;base64,QUJ\\/\"], \"model\": \"synthetic:tiny\"}",
                           16, "synthetic:tiny");
  ASSERT_EQ(r.items.size(), 5u);
  EXPECT_EQ(r.items[0].payload, a);
  EXPECT_EQ(r.items[1].payload, b);
  EXPECT_EQ(r.items[2].payload, c);
  EXPECT_EQ(r.items[3].payload, short_one);
  EXPECT_EQ(r.items[4].payload, "QUJ/");
  const auto nul = parse_encode_request("{\"images\": [\"\\u00000\", \"" + b + "\"]}", 16, "synthetic:tiny");
  ASSERT_EQ(nul.items.size(), 2u);
  EXPECT_EQ(nul.items[0].payload, std::string("\0"
                                              "0",
                                              2));
  EXPECT_EQ(nul.items[1].payload, b);
  EXPECT_EQ(error_of("{\"images\": [\"" + b + "\"] \"x\"}").code, "invalid_json");
  EXPECT_EQ(error_of("{\"images\": [\"" + b).code, "invalid_json");
  EXPECT_EQ(error_of("{\"images\": [\"" + b + "\"], \"model\": \"" + b + "\"}").code, "model_not_found");
}

TEST(EncodeRequest, RefusesHostileJsonFastWithShortMessages) {
  const fovea::Clock::time_point t0 = fovea::Clock::now();
  // Deep nesting followed by another key (crashed the httplib server through recursive copies).
  const std::string deep = "{\"images\": " + std::string(100000, '[') + std::string(100000, ']') + ", \"x\": 1}";
  ApiError e = error_of(deep);
  EXPECT_EQ(e.status, 400);
  EXPECT_EQ(e.code, "invalid_json");
  EXPECT_LT(e.message.size(), 400u) << e.message.substr(0, 400);
  // 100k keys (quadratic in ordered_json: 15 s).
  std::string keys = "{";
  for (int i = 0; i < 100000; ++i) keys += "\"k" + std::to_string(i) + "\": 0,";
  keys += "\"images\": [\"QUJD\"]}";
  e = error_of(keys);
  EXPECT_EQ(e.status, 400);
  // A large array of numbers.
  std::string numbers = "{\"images\": [" + std::string(4 << 20, '0');
  for (size_t i = 1; i + 1 < numbers.size(); i += 2) numbers[i] = ',';
  numbers += "]}";
  e = error_of(numbers);
  EXPECT_EQ(e.status, 400);
  const double s = fovea::seconds_since(t0);
  EXPECT_LT(s, 10.0) << "the hostile bodies took " << s << " s: not linear?";
  // A client value quoted in a message is cut short.
  e = error_of("{\"images\": [\"QUJD\"], \"model\": \"" + std::string(100000, 'm') + "\"}");
  EXPECT_EQ(e.status, 404);
  EXPECT_LT(e.message.size(), 300u);
  e = error_of("{\"images\": [\"QUJD\"], \"" + std::string(100000, 'k') + "\": 1}");
  EXPECT_EQ(e.code, "invalid_request");
  EXPECT_LT(e.message.size(), 300u);
}

// Videos: a video_url part, a data:video URL, the "videos" array; each item's kind and name as said.
TEST(EncodeRequest, VideosBesideImages) {
  using fovea::server::ItemKind;
  const auto r = parse_encode_request(
      "{\"images\": [\"QUJD\", {\"type\": \"video_url\", \"video_url\": {\"url\": \"data:video/mp4;base64,REVG\"}, "
      "\"uuid\": \"clip\"}, \"data:image/png;base64,R0hJ\"], \"videos\": [\"data:video/webm;base64,SktM\", \"TU5P\"]}",
      8, "synthetic:tiny");
  EXPECT_EQ(items_of(r, &RequestItem::payload), (std::vector<std::string>{"QUJD", "REVG", "R0hJ", "SktM", "TU5P"}));
  EXPECT_EQ(items_of(r, &RequestItem::kind),
            (std::vector<ItemKind>{ItemKind::ANY, ItemKind::VIDEO, ItemKind::IMAGE, ItemKind::VIDEO, ItemKind::VIDEO}));
  EXPECT_EQ(items_of(r, &RequestItem::name),
            (std::vector<std::string>{"images[0]", "images[1]", "images[2]", "videos[0]", "videos[1]"}));
  EXPECT_EQ(r.items[1].uuid, "clip");
  EXPECT_EQ(r.items[1].url_prefix, "data:video/mp4;base64,");
  // Only videos; the limit counts both arrays; an image part in "videos"; a malformed video item.
  EXPECT_EQ(parse_encode_request("{\"videos\": [\"QUJD\"]}", 1, "synthetic:tiny").items.size(), 1u);
  EXPECT_EQ(error_of("{\"images\": [\"QUJD\"], \"videos\": [\"QUJD\"]}", 1).code, "too_many_images");
  EXPECT_EQ(error_of("{\"videos\": [{\"type\": \"image_url\", \"image_url\": \"QUJD\"}]}").code, "invalid_video");
  EXPECT_EQ(error_of("{\"videos\": [7]}").code, "invalid_video");
  EXPECT_EQ(error_of("{\"videos\": []}").code, "invalid_request");
  EXPECT_EQ(error_of("{\"videos\": {}}").code, "invalid_request");
  EXPECT_EQ(error_of("{\"images\": [{\"type\": \"video_url\", \"image_url\": \"QUJD\"}]}").code, "invalid_video");
}

TEST(EncodeRequest, RefusesMalformedRequests) {
  EXPECT_EQ(error_of("[1]").code, "invalid_request");
  EXPECT_EQ(error_of("{\"images\": []}").code, "invalid_request");
  EXPECT_EQ(error_of("{\"images\": [\"QUJD\"], \"images\": [\"QUJD\"]}").code, "invalid_json");  // duplicate key
  EXPECT_EQ(error_of("{\"images\": [\"QUJD\", \"QUJD\"]}", 1).code, "too_many_images");
  {  // a URL is kept whole, to be read (or refused) by the server: not base64, never a payload
    const auto r =
        parse_encode_request("{\"images\": [\"http://example.com/a.png\", \"file:///m/b.png\", \"QUJD\"]}", 4, "m");
    EXPECT_EQ(items_of(r, &RequestItem::remote_url),
              (std::vector<std::string>{"http://example.com/a.png", "file:///m/b.png", ""}));
    EXPECT_EQ(items_of(r, &RequestItem::payload), (std::vector<std::string>{"", "", "QUJD"}));
  }
  EXPECT_EQ(error_of("{\"images\": [\"data:image/png,QUJD\"]}").code, "invalid_image");
  EXPECT_EQ(error_of("{\"images\": [{\"type\": \"image_url\"}]}").code, "invalid_image");
  EXPECT_EQ(error_of("{\"images\": [7]}").code, "invalid_image");
  EXPECT_EQ(error_of("{\"images\": [\"QUJD\"], \"encoding\": \"hex\"}").code, "invalid_request");
  EXPECT_EQ(error_of("{\"images\": [\"QUJD\"], \"return_deepstack\": 1}").code, "invalid_request");
  EXPECT_EQ(error_of("{\"images\": [\"QUJD\"], \"model\": \"other\"}").status, 404);
  EXPECT_EQ(error_of("{\"images\": [\"QUJD\"]").code, "invalid_json");
}

}  // namespace
