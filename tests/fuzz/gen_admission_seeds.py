#!/usr/bin/env python3
"""Writes the seed corpus of fuzz_admission (tests/fuzz/corpus_admission).

Each seed is byte 0 (0 STORE, 1 RETRIEVE) then a STORE/RETRIEVE payload
(docs/protocol.md) for the glm-like-hybrid preset with 32 blocks per group
(groups full, sliding, recurrent; chunk_tokens 256, block_size 16), as
fuzz_admission registers it. Rerun after a change of the payload layout
(e.g. the chunk key's width): python3 tests/fuzz/gen_admission_seeds.py
"""
import os
import struct

KEY_BYTES = 32  # chunk keys (protocol version 2: 32 bytes, not all zero)


def key(k):
    return struct.pack('<Q', k).ljust(KEY_BYTES, b'\x00')


def payload(kind, tb, te, keys, groups, fmt=0):
    b = bytes([kind]) + struct.pack('<QQQII', 0, tb, te, fmt, 0) + bytes(64)
    b += struct.pack('<II', len(keys), len(groups))
    b += b''.join(key(k) for k in keys)
    for fb, ids in groups:
        b += struct.pack('<QI', fb, len(ids)) + b''.join(struct.pack('<I', i) for i in ids)
    return b


K = [0x1111, 0x2222]
FULL = (0, list(range(32)))
S, R = 0, 1
SEEDS = {
    'store_two_chunks': payload(S, 0, 512, K, [FULL, (0, list(range(32))), (1, [5])]),
    'retrieve_two_chunks': payload(R, 0, 512, K, [FULL, (0, list(range(32))), (0, [6])]),
    'store_second_chunk': payload(S, 256, 512, [K[1]], [(16, list(range(16, 32))), (16, list(range(16, 32))), (1, [3])]),
    'store_partial_chunk_native': payload(S, 0, 304, K, [(0, list(range(19))), (0, list(range(19))), (0, [])], fmt=1),
    'retrieve_full_group_only': payload(R, 0, 512, K, [FULL, (0, []), (0, [])]),
    'retrieve_window_skips': payload(R, 0, 512, K, [(0, [0xFFFFFFFF] * 16 + list(range(16))), (0, list(range(32))), (0, [1])]),
    'store_top_of_range': payload(S, 2**64 - 256, 2**64 - 255, [0x3333], [(0, [0]), (0, [0]), (0, [0])]),
}

if __name__ == '__main__':
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'corpus_admission')
    os.makedirs(out, exist_ok=True)
    for name, data in SEEDS.items():
        with open(os.path.join(out, name), 'wb') as f:
            f.write(data)
