/* perf/bench_json.h - a small JSON writer for the benchmark's results:
 * objects and arrays written in order, strings escaped, non-finite numbers
 * written as null. Header only. */
#ifndef KVF_PERF_BENCH_JSON_H
#define KVF_PERF_BENCH_JSON_H

#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

namespace kvfb {

class JsonWriter {
 public:
  JsonWriter &begin_object() { return open('{'); }
  JsonWriter &end_object() { return close('}'); }
  JsonWriter &begin_array() { return open('['); }
  JsonWriter &end_array() { return close(']'); }

  /* A key inside an object; the next value (or begin_*) is its value. */
  JsonWriter &key(const std::string &k) {
    comma();
    indent();
    string_literal(k);
    out_ += ": ";
    after_key_ = true;
    return *this;
  }
  JsonWriter &value(const std::string &v) {
    pre_value();
    string_literal(v);
    return *this;
  }
  JsonWriter &value(const char *v) { return v ? value(std::string(v)) : null(); }
  JsonWriter &value(bool v) {
    pre_value();
    out_ += v ? "true" : "false";
    return *this;
  }
  JsonWriter &value(double v) {
    pre_value();
    if (!std::isfinite(v)) {
      out_ += "null";
    } else {
      char b[64];
      snprintf(b, sizeof b, "%.6g", v);
      out_ += b;
    }
    return *this;
  }
  JsonWriter &value(int v) { return value((int64_t)v); }
  JsonWriter &value(unsigned v) { return value((uint64_t)v); }
  JsonWriter &value(int64_t v) {
    pre_value();
    out_ += std::to_string(v);
    return *this;
  }
  JsonWriter &value(uint64_t v) {
    pre_value();
    out_ += std::to_string(v);
    return *this;
  }
  JsonWriter &value(long long v) { return value((int64_t)v); }
  JsonWriter &value(unsigned long long v) { return value((uint64_t)v); }
  JsonWriter &null() {
    pre_value();
    out_ += "null";
    return *this;
  }
  /* key + value in one call. */
  template <class T>
  JsonWriter &kv(const std::string &k, const T &v) {
    key(k);
    return value(v);
  }
  /* Splice an already formatted JSON value. */
  JsonWriter &raw(const std::string &json) {
    pre_value();
    out_ += json;
    return *this;
  }
  const std::string &str() const { return out_; }

 private:
  std::string out_;
  std::vector<bool> first_; /* per open container: nothing written yet */
  bool after_key_ = false;

  void comma() {
    if (!first_.empty()) {
      if (!first_.back()) out_ += ',';
      first_.back() = false;
      out_ += '\n';
    }
  }
  void indent() { out_.append(first_.size() * 2, ' '); }
  void pre_value() {
    if (after_key_) {
      after_key_ = false;
      return;
    }
    comma();
    indent();
  }
  JsonWriter &open(char c) {
    pre_value();
    out_ += c;
    first_.push_back(true);
    return *this;
  }
  JsonWriter &close(char c) {
    bool empty = first_.back();
    first_.pop_back();
    if (!empty) {
      out_ += '\n';
      indent();
    }
    out_ += c;
    return *this;
  }
  void string_literal(const std::string &s) {
    out_ += '"';
    for (unsigned char ch : s) {
      switch (ch) {
        case '"': out_ += "\\\""; break;
        case '\\': out_ += "\\\\"; break;
        case '\n': out_ += "\\n"; break;
        case '\r': out_ += "\\r"; break;
        case '\t': out_ += "\\t"; break;
        default:
          if (ch < 0x20) {
            char b[8];
            snprintf(b, sizeof b, "\\u%04x", ch);
            out_ += b;
          } else {
            out_ += (char)ch;
          }
      }
    }
    out_ += '"';
  }
};

} // namespace kvfb

#endif
