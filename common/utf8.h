/* Internal: strict UTF-8 validation (RFC 3629), for names a peer sends. */
#ifndef KVF_COMMON_UTF8_H
#define KVF_COMMON_UTF8_H

#include <stddef.h>
#include <stdint.h>

/* Whether s[0..n) is well-formed UTF-8: no overlong encodings, no
 * surrogates (U+D800..U+DFFF), nothing above U+10FFFF, no sequence cut
 * short. On failure *bad (may be NULL) gets the offset of the first byte of
 * the offending sequence and *why a short reason. */
static inline int kvf_utf8_valid(const void *data, size_t n, size_t *bad, const char **why) {
  const uint8_t *s = (const uint8_t *)data;
  size_t i = 0;
  while (i < n) {
    uint8_t c = s[i];
    const char *w = NULL;
    size_t len = 0;
    uint32_t min = 0, cp = 0;
    if (c < 0x80) {
      i++;
      continue;
    } else if (c >= 0xc2 && c <= 0xdf) {
      len = 2, min = 0x80, cp = c & 0x1fu;
    } else if (c >= 0xe0 && c <= 0xef) {
      len = 3, min = 0x800, cp = c & 0x0fu;
    } else if (c >= 0xf0 && c <= 0xf4) {
      len = 4, min = 0x10000, cp = c & 0x07u;
    } else {
      w = c == 0xc0 || c == 0xc1 ? "an overlong encoding" : c >= 0xf5 ? "a byte never used in UTF-8"
                                                                        : "a continuation byte without a lead byte";
    }
    if (!w && n - i < len) w = "a sequence cut short";
    for (size_t k = 1; !w && k < len; k++) {
      if ((s[i + k] & 0xc0) != 0x80) w = "a sequence cut short";
      cp = (cp << 6) | (s[i + k] & 0x3fu);
    }
    if (!w && cp < min) w = "an overlong encoding";
    if (!w && cp >= 0xd800 && cp <= 0xdfff) w = "a surrogate (U+D800..U+DFFF)";
    if (!w && cp > 0x10ffff) w = "a code point above U+10FFFF";
    if (w) {
      if (bad) *bad = i;
      if (why) *why = w;
      return 0;
    }
    i += len;
  }
  return 1;
}

#endif /* KVF_COMMON_UTF8_H */
