#pragma once
// File I/O shared by the host drivers (tests/data/*_on_host.cpp): a case's inputs read and its outputs written as raw
// bytes, which the Python side reads and writes with numpy/torch.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace host_cuda {

// The file's bytes as values of T (a missing file ends the run: the test names its case directory).
template <typename T = unsigned char>
std::vector<T> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "cannot read %s\n", path.c_str());
    std::exit(2);
  }
  const std::vector<char> bytes{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  std::vector<T> values(bytes.size() / sizeof(T));
  std::memcpy(values.data(), bytes.data(), values.size() * sizeof(T));
  return values;
}

inline void write_file(const std::string& path, const void* data, size_t bytes) {
  std::ofstream(path, std::ios::binary).write(static_cast<const char*>(data), std::streamsize(bytes));
}

template <typename T>
void write_file(const std::string& path, const std::vector<T>& values) {
  write_file(path, values.data(), values.size() * sizeof(T));
}

}  // namespace host_cuda
