/* libFuzzer target for the kvferryd frame decoder (host/protocol.h).
 *
 * The input is a byte stream as a peer could send it. It goes through the
 * incremental reader in pieces whose sizes come from the input itself, and
 * every whole frame is decoded; a decoded message is encoded again and must
 * decode to the same bytes. Any crash, leak, sanitizer report or broken
 * round trip is a bug. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "host/ipc/protocol.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check_frame(const kvf_proto_header *h, const uint8_t *payload) {
  kvf_proto_msg m;
  if (kvf_proto_decode(h, payload, &m) != KVF_SUCCESS) return;
  uint8_t *buf = NULL;
  size_t len = 0;
  if (kvf_proto_encode(&m, &buf, &len) != KVF_SUCCESS) abort(); /* what decodes must encode */
  /* The re-encoding equals the original frame's payload, byte for byte. */
  if (len != KVF_PROTO_HEADER_SIZE + h->payload_len) abort();
  if (h->payload_len && memcmp(buf + KVF_PROTO_HEADER_SIZE, payload, h->payload_len) != 0) abort();
  kvf_proto_msg again;
  if (kvf_proto_frame_decode(buf, len, &again) != KVF_SUCCESS) abort();
  kvf_proto_msg_clear(&again);
  free(buf);
  kvf_proto_msg_clear(&m);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  /* The whole input as one frame. */
  kvf_proto_msg m;
  if (kvf_proto_frame_decode(data, size, &m) == KVF_SUCCESS) kvf_proto_msg_clear(&m);

  /* As a stream, fed in pieces of 1..16 bytes chosen by the first byte. */
  if (size == 0) return 0;
  unsigned step = (data[0] & 15u) + 1u;
  kvf_proto_reader r;
  kvf_proto_reader_init(&r, 1u << 20);
  size_t pos = 1;
  while (pos < size) {
    size_t n = size - pos < step ? size - pos : step, used = 0;
    int ready = 0;
    if (kvf_proto_reader_feed(&r, data + pos, n, &used, &ready) != KVF_SUCCESS) break;
    pos += used;
    if (ready) {
      kvf_proto_header h;
      uint8_t *payload = NULL;
      if (kvf_proto_reader_take(&r, &h, &payload) != KVF_SUCCESS) abort();
      check_frame(&h, payload);
      free(payload);
    } else if (used == 0) {
      abort(); /* a healthy reader that is not full always takes bytes */
    }
  }
  kvf_proto_reader_reset(&r);
  return 0;
}
