// A minimal string builder for error messages: s << "rank " << 3 << ...
// Why not std::ostringstream: on the GPU machines (torch 2.11 cu130, g++ 13) any
// ostream formatting of an integer inside a torch extension segfaults (probed with
// tools/probe_exceptions.py: throw with std::to_string works, `ostream << 5` dies),
// which turned every ring error into a crash there. std::to_string avoids iostreams.
#pragma once

#include <string>
#include <type_traits>

namespace prime::ring {

class StrBuilder {
 public:
  StrBuilder& operator<<(const std::string& v) { out_ += v; return *this; }
  StrBuilder& operator<<(const char* v) { out_ += v; return *this; }
  StrBuilder& operator<<(char v) { out_ += v; return *this; }
  template <typename T, typename = std::enable_if_t<std::is_arithmetic_v<T>>>
  StrBuilder& operator<<(T v) {
    if constexpr (std::is_same_v<T, bool>) {
      out_ += v ? "true" : "false";
    } else {
      out_ += std::to_string(v);
    }
    return *this;
  }
  std::string str() const { return out_; }

 private:
  std::string out_;
};

}  // namespace prime::ring
