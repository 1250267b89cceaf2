// Test helpers for 32-byte chunk keys (kvferry/client.h): comparison and
// printing for gtest, and a key made from a 64-bit number for tests that
// name keys by number.
#ifndef KVF_TESTS_CHUNK_KEY_UTIL_H
#define KVF_TESTS_CHUNK_KEY_UTIL_H

#include <stdint.h>
#include <string.h>

#include <ostream>
#include <string>

#include <kvferry/client.h>

inline bool operator==(const kvf_chunk_key &a, const kvf_chunk_key &b) { return memcmp(&a, &b, sizeof a) == 0; }
inline bool operator!=(const kvf_chunk_key &a, const kvf_chunk_key &b) { return !(a == b); }
inline bool operator<(const kvf_chunk_key &a, const kvf_chunk_key &b) { return memcmp(&a, &b, sizeof a) < 0; }

inline std::string KeyHex(const kvf_chunk_key &k) {
  static const char digits[] = "0123456789abcdef";
  std::string s;
  for (uint8_t b : k.bytes) {
    s += digits[b >> 4];
    s += digits[b & 15];
  }
  return s;
}

inline std::ostream &operator<<(std::ostream &os, const kvf_chunk_key &k) { return os << KeyHex(k); }

// The key whose first 8 bytes are v (little-endian), the rest zero: v 0 is
// the all-zero key, which is not a key.
inline kvf_chunk_key KeyOf(uint64_t v) {
  kvf_chunk_key k;
  memset(&k, 0, sizeof k);
  for (unsigned i = 0; i < 8; i++) k.bytes[i] = (uint8_t)(v >> (8 * i));
  return k;
}

// The number KeyOf made the key from.
inline uint64_t KeyNum(const kvf_chunk_key &k) {
  uint64_t v = 0;
  for (unsigned i = 0; i < 8; i++) v |= (uint64_t)k.bytes[i] << (8 * i);
  return v;
}

#endif
