// fovea/io.h: whole-file reads and atomic writes (a temporary file in the same folder, fsync, rename),
// so no output of fovea is ever left half-written.
#pragma once
#include <string>

namespace fovea {

// Throws fovea::Error "<what> '<path>': <reason>".
std::string read_file(const std::string& path, const std::string& what = "file");
void write_file_atomic(const std::string& path, const std::string& contents, const std::string& what = "file");

}  // namespace fovea
