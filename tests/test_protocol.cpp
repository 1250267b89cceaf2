// The kvferryd wire protocol codec (host/protocol.h): round trips of every
// message, every rejection naming its field, the incremental reader.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "host/ipc/protocol.h"

namespace {

std::vector<uint8_t> Encode(const kvf_proto_msg &m) {
  uint8_t *buf = nullptr;
  size_t len = 0;
  kvf_status st = kvf_proto_encode(&m, &buf, &len);
  EXPECT_EQ(st, KVF_SUCCESS) << kvf_last_error();
  std::vector<uint8_t> v(buf, buf + len);
  free(buf);
  return v;
}

kvf_status Decode(const std::vector<uint8_t> &f, kvf_proto_msg *out) {
  return kvf_proto_frame_decode(f.data(), f.size(), out);
}

// Decoding must fail with KVF_ERR_PROTOCOL and a message naming `field`.
void ExpectReject(const std::vector<uint8_t> &f, const std::string &field) {
  kvf_proto_msg m;
  memset(&m, 0, sizeof m);
  kvf_status st = Decode(f, &m);
  EXPECT_EQ(st, KVF_ERR_PROTOCOL) << "expected a rejection naming " << field;
  EXPECT_NE(std::string(kvf_last_error()).find(field), std::string::npos)
      << "message '" << kvf_last_error() << "' does not name " << field;
  if (st == KVF_SUCCESS) kvf_proto_msg_clear(&m);
}

void PutLe(std::vector<uint8_t> &f, size_t at, uint64_t v, unsigned n) {
  for (unsigned i = 0; i < n; i++) f[at + i] = (uint8_t)(v >> (8 * i));
}
// Fix the header's payload length after editing a frame's payload.
void FixLen(std::vector<uint8_t> &f) { PutLe(f, 16, f.size() - KVF_PROTO_HEADER_SIZE, 4); }

kvf_proto_msg Msg(uint16_t type, uint64_t rid = 42) {
  kvf_proto_msg m;
  memset(&m, 0, sizeof m);
  m.type = type;
  m.request_id = rid;
  return m;
}

kvf_proto_msg Hello() {
  kvf_proto_msg m = Msg(KVF_PROTO_HELLO);
  m.u.hello.min_version = 2;
  m.u.hello.max_version = 2;
  m.u.hello.pid = 1234;
  m.u.hello.instance_id = 0xABCDEF0123456789ull;
  m.u.hello.generation = 3;
  strcpy(m.u.hello.name, "engine-0");
  return m;
}

// A STORE (with a CUDA event to wait for) or RETRIEVE of 4 chunks and 3
// groups; keys and block ids live in `keys` and `ids`.
// A 32-byte key whose bytes are `b` (byte 0 is b + 0, byte 31 is b + 31).
kvf_chunk_key Key(uint8_t b) {
  kvf_chunk_key k;
  for (unsigned i = 0; i < KVF_CHUNK_KEY_BYTES; i++) k.bytes[i] = (uint8_t)(b + i);
  return k;
}

struct Xfer {
  std::vector<kvf_chunk_key> keys = {Key(0x11), Key(0x55), Key(0x99), Key(1)};
  std::vector<uint32_t> ids[3];
  kvf_proto_group groups[3];
  kvf_proto_msg m;
  explicit Xfer(uint16_t type = KVF_PROTO_STORE) {
    m = Msg(type, 7);
    m.u.xfer.registration_id = 9;
    m.u.xfer.token_begin = 256;
    m.u.xfer.token_end = 512;
    m.u.xfer.format = 1;
    if (type == KVF_PROTO_STORE) {
      m.u.xfer.ready_kind = KVF_PROTO_READY_CUDA_EVENT;
      for (unsigned b = 0; b < KVF_PROTO_READY_HANDLE_BYTES; b++) m.u.xfer.ready_handle[b] = (uint8_t)(b + 1);
    }
    m.u.xfer.chunk_keys = keys.data();
    m.u.xfer.num_chunk_keys = (uint32_t)keys.size();
    for (int g = 0; g < 3; g++) {
      for (uint32_t k = 0; k < (uint32_t)(g + 1) * 5; k++) ids[g].push_back(k * 7 + (uint32_t)g);
      if (g == 2) ids[g].push_back(0xFFFFFFFFu);
      groups[g].first_block = 16u * (uint32_t)g;
      groups[g].block_ids = ids[g].data();
      groups[g].count = (uint32_t)ids[g].size();
    }
    m.u.xfer.groups = groups;
    m.u.xfer.num_groups = 3;
  }
};

// A RETRIEVE_REPLY (2 groups, 2 object groups) or STORE_REPLY (no object
// groups); the arrays live in the struct.
struct XferReply {
  uint64_t blocks[2] = {12, 0};
  uint64_t og_prefix[2] = {448, 256};
  kvf_proto_msg m;
  explicit XferReply(uint16_t type = KVF_PROTO_RETRIEVE_REPLY) {
    m = Msg(type, 7);
    kvf_proto_xfer_reply &r = m.u.xfer_reply;
    r.status = KVF_SUCCESS;
    r.outcome = 1;
    r.prefix_tokens = 448;
    r.objects_done = type == KVF_PROTO_STORE_REPLY ? 3 : 2;
    r.objects_present = type == KVF_PROTO_STORE_REPLY ? 1 : 0;
    r.bytes_done = 3u << 20;
    r.group_blocks = blocks;
    r.num_groups = 2;
    if (type == KVF_PROTO_RETRIEVE_REPLY) {
      r.og_prefix_tokens = og_prefix;
      r.num_object_groups = 2;
    }
  }
};

struct Register {
  std::string json = "{\"format\":\"kvferry-geometry\",\"version\":1}";
  kvf_proto_region regions[2];
  kvf_proto_msg m;
  Register() {
    m = Msg(KVF_PROTO_REGISTER, 5);
    memset(regions, 0, sizeof regions);
    for (int i = 0; i < 2; i++) {
      regions[i].instance_id = 77;
      regions[i].allocation_id = 100u + (uint32_t)i;
      regions[i].generation = 1;
      regions[i].size = 4u << 20;
      for (int b = 0; b < 16; b++) regions[i].device_uuid[b] = (uint8_t)(b * 3 + i);
      regions[i].provider = 2;
      regions[i].offset = 2u << 20;
      regions[i].length = 2u << 20;
      regions[i].fd_index = (uint32_t)i;
    }
    m.u.reg.device = 1;
    m.u.reg.num_fds = 2;
    m.u.reg.shard_index = 3;
    m.u.reg.shard_count = 4;
    m.u.reg.geometry_json = &json[0];
    m.u.reg.geometry_json_len = (uint32_t)json.size();
    m.u.reg.regions = regions;
    m.u.reg.num_regions = 2;
  }
};

// Payload offsets used by the edits below (docs/protocol.md tables).
constexpr size_t H = KVF_PROTO_HEADER_SIZE;

}  // namespace

TEST(Protocol, HeaderLayoutIsLittleEndianAndFixed) {
  kvf_proto_msg m = Msg(KVF_PROTO_HEARTBEAT, 0x0102030405060708ull);
  m.u.heartbeat.sequence = 5;
  std::vector<uint8_t> f = Encode(m);
  ASSERT_EQ(f.size(), H + 8);
  const uint8_t want[] = {'K', 'V', 'F', 'P', 2, 0, 4, 0, 8, 7, 6, 5, 4, 3, 2, 1, 8, 0, 0, 0, 0, 0, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0};
  ASSERT_EQ(sizeof want, f.size());
  EXPECT_EQ(0, memcmp(want, f.data(), sizeof want));
}

TEST(Protocol, RoundTripHelloAndReply) {
  kvf_proto_msg in = Hello(), out;
  ASSERT_EQ(Decode(Encode(in), &out), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(out.type, KVF_PROTO_HELLO);
  EXPECT_EQ(out.request_id, 42u);
  EXPECT_EQ(out.u.hello.pid, 1234u);
  EXPECT_EQ(out.u.hello.instance_id, in.u.hello.instance_id);
  EXPECT_EQ(out.u.hello.generation, 3u);
  EXPECT_STREQ(out.u.hello.name, "engine-0");
  kvf_proto_msg_clear(&out);

  kvf_proto_msg r = Msg(KVF_PROTO_HELLO_REPLY);
  r.u.hello_reply = {2, 99, 0x1122334455667788ull, 17, 1000, 5000, KVF_PROTO_MAX_PAYLOAD};
  ASSERT_EQ(Decode(Encode(r), &out), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(0, memcmp(&out.u.hello_reply, &r.u.hello_reply, sizeof r.u.hello_reply));
  kvf_proto_msg_clear(&out);
}

TEST(Protocol, RoundTripRegisterAndReply) {
  Register in;
  kvf_proto_msg out;
  ASSERT_EQ(Decode(Encode(in.m), &out), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(out.u.reg.device, 1);
  EXPECT_EQ(out.u.reg.num_fds, 2u);
  EXPECT_EQ(out.u.reg.shard_index, 3u);
  EXPECT_EQ(out.u.reg.shard_count, 4u);
  EXPECT_EQ(std::string(out.u.reg.geometry_json), in.json);
  EXPECT_EQ(out.u.reg.geometry_json_len, in.json.size());
  ASSERT_EQ(out.u.reg.num_regions, 2u);
  for (int i = 0; i < 2; i++) EXPECT_EQ(0, memcmp(&out.u.reg.regions[i], &in.regions[i], sizeof in.regions[i]));
  kvf_proto_msg_clear(&out);

  kvf_proto_msg r = Msg(KVF_PROTO_REGISTER_REPLY);
  r.u.register_reply = {12, 0xFEEDull, 3, 5};
  ASSERT_EQ(Decode(Encode(r), &out), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(0, memcmp(&out.u.register_reply, &r.u.register_reply, sizeof r.u.register_reply));
  kvf_proto_msg_clear(&out);
}

TEST(Protocol, RoundTripSmallMessages) {
  kvf_proto_msg out;
  kvf_proto_msg a = Msg(KVF_PROTO_UNREGISTER);
  a.u.unregister.registration_id = 12;
  ASSERT_EQ(Decode(Encode(a), &out), KVF_SUCCESS);
  EXPECT_EQ(out.u.unregister.registration_id, 12u);
  kvf_proto_msg b = Msg(KVF_PROTO_UNREGISTER_REPLY);
  b.u.unregister_reply = {12, KVF_PROTO_REG_CLOSED};
  ASSERT_EQ(Decode(Encode(b), &out), KVF_SUCCESS);
  EXPECT_EQ(out.u.unregister_reply.state, (uint32_t)KVF_PROTO_REG_CLOSED);
  kvf_proto_msg c = Msg(KVF_PROTO_HEARTBEAT_REPLY);
  c.u.heartbeat_reply = {8, 0xB007ull};
  ASSERT_EQ(Decode(Encode(c), &out), KVF_SUCCESS);
  EXPECT_EQ(out.u.heartbeat_reply.boot_token, 0xB007ull);
  EXPECT_EQ(out.u.heartbeat_reply.sequence, 8u);
  kvf_proto_msg d = Msg(KVF_PROTO_STAT);
  d.u.stat.flags = KVF_PROTO_STAT_PER_CLIENT;
  ASSERT_EQ(Decode(Encode(d), &out), KVF_SUCCESS);
  EXPECT_EQ(out.u.stat.flags, KVF_PROTO_STAT_PER_CLIENT);
  kvf_proto_msg g = Msg(KVF_PROTO_ERROR);
  g.u.error.status = KVF_ERR_PROTOCOL;
  g.u.error.version = 1;
  strcpy(g.u.error.field, "payload.groups[2].block_ids");
  strcpy(g.u.error.message, "count 9000 exceeds the 8192 limit");
  ASSERT_EQ(Decode(Encode(g), &out), KVF_SUCCESS);
  EXPECT_EQ(out.u.error.status, (uint32_t)KVF_ERR_PROTOCOL);
  EXPECT_STREQ(out.u.error.field, g.u.error.field);
  EXPECT_STREQ(out.u.error.message, g.u.error.message);
}

TEST(Protocol, RoundTripStatReply) {
  kvf_proto_stat_client clients[2];
  memset(clients, 0, sizeof clients);
  clients[0].client_id = 1;
  clients[0].pid = 10;
  strcpy(clients[0].name, "a");
  clients[0].counters = {{0, 1, 0, 0, 0}, 2, 3, 4};
  clients[1].client_id = 2;
  clients[1].pid = 20;
  clients[1].counters = {{0, 0, 1, 0, 1}, 5, 6, 7};
  kvf_proto_msg in = Msg(KVF_PROTO_STAT_REPLY), out;
  in.u.stat_reply.boot_token = 0xB0;
  in.u.stat_reply.total = {{0, 1, 1, 0, 1}, 7, 9, 11};
  in.u.stat_reply.data = {101, 102, 103, 104, 105, 106, 107, 3};
  in.u.stat_reply.clients = clients;
  in.u.stat_reply.num_clients = 2;
  ASSERT_EQ(Decode(Encode(in), &out), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(out.u.stat_reply.boot_token, 0xB0u);
  EXPECT_EQ(out.u.stat_reply.data.l1_objects, 101u);
  EXPECT_EQ(out.u.stat_reply.data.l1_bytes, 102u);
  EXPECT_EQ(out.u.stat_reply.data.l1_pool_bytes, 103u);
  EXPECT_EQ(out.u.stat_reply.data.l1_evicted_entries_total, 104u);
  EXPECT_EQ(out.u.stat_reply.data.stores_total, 105u);
  EXPECT_EQ(out.u.stat_reply.data.retrieves_total, 106u);
  EXPECT_EQ(out.u.stat_reply.data.in_flight, 107u);
  EXPECT_EQ(out.u.stat_reply.data.lanes, 3u);
  EXPECT_EQ(0, memcmp(&out.u.stat_reply.total, &in.u.stat_reply.total, sizeof in.u.stat_reply.total));
  ASSERT_EQ(out.u.stat_reply.num_clients, 2u);
  for (int i = 0; i < 2; i++) EXPECT_EQ(0, memcmp(&out.u.stat_reply.clients[i], &clients[i], sizeof clients[i]));
  kvf_proto_msg_clear(&out);
}

// The peers section (KVF_PROTO_STAT_PEERS): present when the server was
// asked, absent otherwise; a bad state is refused naming the record.
TEST(Protocol, RoundTripStatReplyWithPeers) {
  kvf_proto_stat_peer peers[2];
  memset(peers, 0, sizeof peers);
  strcpy(peers[0].addr, "10.0.0.2:7000");
  peers[0].state = 2;
  peers[0].outgoing = 1;
  peers[0].boot_token = 0xABCD;
  peers[0].connects = 3;
  peers[0].objects_pulled = 40;
  peers[0].bytes_pulled = 4096;
  peers[0].objects_served = 5;
  peers[0].failures = 1;
  strcpy(peers[1].addr, "incoming");
  kvf_proto_msg in = Msg(KVF_PROTO_STAT_REPLY), out;
  in.u.stat_reply.has_peers = 1;
  in.u.stat_reply.peers = peers;
  in.u.stat_reply.num_peers = 2;
  ASSERT_EQ(Decode(Encode(in), &out), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(out.u.stat_reply.has_peers, 1u);
  ASSERT_EQ(out.u.stat_reply.num_peers, 2u);
  for (int i = 0; i < 2; i++) EXPECT_EQ(0, memcmp(&out.u.stat_reply.peers[i], &peers[i], sizeof peers[i])) << i;
  kvf_proto_msg_clear(&out);
  kvf_proto_msg none = Msg(KVF_PROTO_STAT_REPLY);
  ASSERT_EQ(Decode(Encode(none), &out), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(out.u.stat_reply.has_peers, 0u);
  EXPECT_EQ(out.u.stat_reply.num_peers, 0u);
  kvf_proto_msg_clear(&out);
  peers[1].state = 7;
  EXPECT_EQ(Decode(Encode(in), &out), KVF_ERR_PROTOCOL);
  EXPECT_NE(std::string(kvf_last_error()).find("payload.peers[1].state"), std::string::npos) << kvf_last_error();
}

TEST(Protocol, RoundTripStoreAndRetrieve) {
  for (uint16_t t : {KVF_PROTO_STORE, KVF_PROTO_RETRIEVE}) {
    Xfer in(t);
    kvf_proto_msg out;
    ASSERT_EQ(Decode(Encode(in.m), &out), KVF_SUCCESS) << kvf_last_error();
    EXPECT_EQ(out.type, t);
    EXPECT_EQ(out.u.xfer.registration_id, 9u);
    EXPECT_EQ(out.u.xfer.token_begin, 256u);
    EXPECT_EQ(out.u.xfer.token_end, 512u);
    EXPECT_EQ(out.u.xfer.format, 1u);
    EXPECT_EQ(out.u.xfer.ready_kind, in.m.u.xfer.ready_kind);
    EXPECT_EQ(0, memcmp(out.u.xfer.ready_handle, in.m.u.xfer.ready_handle, KVF_PROTO_READY_HANDLE_BYTES));
    ASSERT_EQ(out.u.xfer.num_chunk_keys, 4u);
    EXPECT_EQ(0, memcmp(out.u.xfer.chunk_keys, in.keys.data(), 4 * KVF_CHUNK_KEY_BYTES));
    ASSERT_EQ(out.u.xfer.num_groups, 3u);
    for (int g = 0; g < 3; g++) {
      EXPECT_EQ(out.u.xfer.groups[g].first_block, in.groups[g].first_block);
      ASSERT_EQ(out.u.xfer.groups[g].count, in.ids[g].size());
      EXPECT_EQ(0, memcmp(out.u.xfer.groups[g].block_ids, in.ids[g].data(), in.ids[g].size() * 4));
    }
    kvf_proto_msg_clear(&out);
  }
}

TEST(Protocol, RoundTripXferReplies) {
  for (uint16_t t : {KVF_PROTO_STORE_REPLY, KVF_PROTO_RETRIEVE_REPLY}) {
    XferReply in(t);
    kvf_proto_msg out;
    ASSERT_EQ(Decode(Encode(in.m), &out), KVF_SUCCESS) << kvf_last_error();
    const kvf_proto_xfer_reply &a = in.m.u.xfer_reply, &b = out.u.xfer_reply;
    EXPECT_EQ(out.type, t);
    EXPECT_EQ(b.status, 0u);
    EXPECT_EQ(b.outcome, 1u);
    EXPECT_EQ(b.prefix_tokens, a.prefix_tokens);
    EXPECT_EQ(b.objects_done, a.objects_done);
    EXPECT_EQ(b.objects_present, a.objects_present);
    EXPECT_EQ(b.bytes_done, a.bytes_done);
    ASSERT_EQ(b.num_groups, 2u);
    EXPECT_EQ(b.group_blocks[0], 12u);
    EXPECT_EQ(b.group_blocks[1], 0u);
    ASSERT_EQ(b.num_object_groups, a.num_object_groups);
    if (t == KVF_PROTO_RETRIEVE_REPLY) {
      EXPECT_EQ(b.og_prefix_tokens[0], 448u);
      EXPECT_EQ(b.og_prefix_tokens[1], 256u);
    } else {
      EXPECT_EQ(b.og_prefix_tokens, nullptr);
    }
    EXPECT_STREQ(b.message, "");
    kvf_proto_msg_clear(&out);
  }
  // Not done: a failing status and the reason; no arrays at all.
  kvf_proto_msg f = Msg(KVF_PROTO_STORE_REPLY);
  f.u.xfer_reply.status = KVF_ERR_TIMEOUT;
  f.u.xfer_reply.outcome = 4;
  f.u.xfer_reply.prefix_tokens = 256;
  strcpy(f.u.xfer_reply.message, "the copy did not finish within 2000 ms");
  kvf_proto_msg out;
  ASSERT_EQ(Decode(Encode(f), &out), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(out.u.xfer_reply.status, (uint32_t)KVF_ERR_TIMEOUT);
  EXPECT_EQ(out.u.xfer_reply.outcome, 4u);
  EXPECT_EQ(out.u.xfer_reply.num_groups, 0u);
  EXPECT_EQ(out.u.xfer_reply.group_blocks, nullptr);
  EXPECT_STREQ(out.u.xfer_reply.message, f.u.xfer_reply.message);
  kvf_proto_msg_clear(&out);
}

TEST(Protocol, HeaderRejectionsNameTheirField) {
  std::vector<uint8_t> good = Encode(Hello());
  auto f = good;
  f[0] = 'X';
  ExpectReject(f, "header.magic");
  f = good;
  PutLe(f, 6, 0x0042, 2);
  ExpectReject(f, "header.type");
  f = good;
  PutLe(f, 20, 1, 4);
  ExpectReject(f, "header.flags");
  f = good;
  PutLe(f, 16, KVF_PROTO_MAX_PAYLOAD + 1, 4);
  ExpectReject(f, "header.payload_len");
  f = good;
  f.pop_back();
  ExpectReject(f, "header.payload_len");  // truncated: fewer bytes than it says
  ExpectReject(std::vector<uint8_t>(good.begin(), good.begin() + 10), "header");
}

TEST(Protocol, VersionMismatchSaysBothVersions) {
  std::vector<uint8_t> f = Encode(Hello());
  PutLe(f, 4, 7, 2);
  kvf_proto_header h;
  EXPECT_EQ(kvf_proto_header_decode(f.data(), 0, &h), KVF_ERR_PROTOCOL);
  std::string msg = kvf_last_error();
  EXPECT_NE(msg.find("header.version"), std::string::npos) << msg;
  EXPECT_NE(msg.find("version 7"), std::string::npos) << msg;
  EXPECT_NE(msg.find("speaks 2"), std::string::npos) << msg;
  EXPECT_EQ(h.request_id, 42u);  // still known, so the ERROR reply can be addressed

  uint16_t v = 0;
  EXPECT_EQ(kvf_proto_negotiate(1, 3, &v), KVF_SUCCESS);
  EXPECT_EQ(v, 2);
  EXPECT_EQ(kvf_proto_negotiate(3, 4, &v), KVF_ERR_PROTOCOL);
  msg = kvf_last_error();
  EXPECT_NE(msg.find("3..4"), std::string::npos) << msg;
  EXPECT_NE(msg.find("2..2"), std::string::npos) << msg;
  // A version-1 client (8-byte keys, no shard) is refused, naming both.
  EXPECT_EQ(kvf_proto_negotiate(1, 1, &v), KVF_ERR_PROTOCOL);
  msg = kvf_last_error();
  EXPECT_NE(msg.find("client speaks protocol versions 1..1, this side speaks 2..2"), std::string::npos) << msg;
  f = Encode(Hello());
  PutLe(f, 4, 1, 2);
  EXPECT_EQ(kvf_proto_header_decode(f.data(), 0, &h), KVF_ERR_PROTOCOL);
  msg = kvf_last_error();
  EXPECT_NE(msg.find("peer speaks protocol version 1, this side speaks 2"), std::string::npos) << msg;
}

TEST(Protocol, HelloRejections) {
  std::vector<uint8_t> good = Encode(Hello());
  auto f = good;
  PutLe(f, H + 0, 0, 2);
  ExpectReject(f, "payload.min_version");
  f = good;
  PutLe(f, H + 0, 3, 2);
  ExpectReject(f, "payload.max_version");
  f = good;
  PutLe(f, H + 8, 0, 8);
  ExpectReject(f, "payload.instance_id");
  f = good;
  f[H + 28] = 'x';  // "engine-0" -> NUL inside? no: set a NUL in the name
  f[H + 28 + 2] = 0;
  ExpectReject(f, "payload.name");
  f = good;
  PutLe(f, H + 24, 64, 4);  // name length over the 63-byte limit
  ExpectReject(f, "payload.name");
  f = good;
  f.push_back(0);
  FixLen(f);
  ExpectReject(f, "payload: 1 bytes left over");
  f = good;
  f.resize(H + 20);
  FixLen(f);
  ExpectReject(f, "payload.generation");
}

// HELLO names are UTF-8 (docs/protocol.md, "Encodings"): what is not
// well-formed is refused naming payload.name by the decoder and hello.name
// by the encoder; well-formed names of every length class pass.
TEST(Protocol, HelloNamesMustBeUtf8) {
  // A name frame: HELLO with `name` as the name's bytes.
  auto frame = [](const std::string &name) {
    std::vector<uint8_t> f = Encode(Hello());
    f.resize(H + 28);  // up to the name's length
    PutLe(f, H + 24, name.size(), 4);
    f.insert(f.end(), name.begin(), name.end());
    FixLen(f);
    return f;
  };
  const std::pair<const char *, std::string> bad[] = {
      {"overlong '/' (C0 AF)", "a\xc0\xaf"},
      {"overlong NUL (C0 80)", "\xc0\x80"},
      {"overlong 3-byte (E0 80 AF)", "x\xe0\x80\xaf"},
      {"overlong 4-byte (F0 82 82 AC)", "\xf0\x82\x82\xac"},
      {"surrogate U+D800 (ED A0 80)", "\xed\xa0\x80"},
      {"surrogate U+DFFF (ED BF BF)", "ok\xed\xbf\xbf"},
      {"U+110000 (F4 90 80 80)", "\xf4\x90\x80\x80"},
      {"F5 lead byte", "\xf5\x80\x80\x80"},
      {"FF byte", "name\xff"},
      {"lone continuation byte", "\x80"},
      {"truncated 2-byte sequence at the end", "abc\xc3"},
      {"truncated 3-byte sequence at the end", "\xe2\x82"},
      {"truncated 4-byte sequence, then ASCII", "\xf0\x9f\x98x"},
  };
  for (const auto &b : bad) {
    SCOPED_TRACE(b.first);
    ExpectReject(frame(b.second), "payload.name: not UTF-8");
    kvf_proto_msg m = Hello();
    std::snprintf(m.u.hello.name, sizeof m.u.hello.name, "%s", b.second.c_str());
    uint8_t *buf = nullptr;
    size_t len = 0;
    EXPECT_EQ(kvf_proto_encode(&m, &buf, &len), KVF_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(std::string(kvf_last_error()).rfind("hello.name: not UTF-8", 0), 0u) << kvf_last_error();
    std::free(buf);
  }
  const char *good[] = {"", "engine-0", "w\xc3\xb6rker", "\xe2\x82\xac", "\xef\xbf\xbf", "\xf0\x9f\x98\x80",
                        "\xf4\x8f\xbf\xbf", "\xed\x9f\xbf", "\x1b[31mred"};
  for (const char *g : good) {
    SCOPED_TRACE(g);
    kvf_proto_msg out;
    ASSERT_EQ(Decode(frame(g), &out), KVF_SUCCESS) << kvf_last_error();
    EXPECT_STREQ(out.u.hello.name, g);
    kvf_proto_msg_clear(&out);
  }
}

TEST(Protocol, HelloReplyRejections) {
  kvf_proto_msg r = Msg(KVF_PROTO_HELLO_REPLY);
  r.u.hello_reply = {2, 99, 1, 17, 1000, 5000, 65536};
  std::vector<uint8_t> good = Encode(r);
  auto f = good;
  PutLe(f, H + 0, 0, 2);
  ExpectReject(f, "payload.version");
  f = good;
  PutLe(f, H + 2, 1, 2);
  ExpectReject(f, "payload.reserved");
  f = good;
  PutLe(f, H + 24, 0, 4);
  ExpectReject(f, "payload.heartbeat_period_ms");
  f = good;
  PutLe(f, H + 28, 1000, 4);
  ExpectReject(f, "payload.heartbeat_timeout_ms");
  f = good;
  PutLe(f, H + 32, 100, 4);
  ExpectReject(f, "payload.max_payload");
}

TEST(Protocol, RegisterRejections) {
  Register in;
  std::vector<uint8_t> good = Encode(in.m);
  const size_t json_at = H + 20, regions_at = json_at + 4 + in.json.size();
  auto f = good;
  PutLe(f, H + 0, (uint32_t)-2, 4);
  ExpectReject(f, "payload.device");
  f = good;
  PutLe(f, H + 4, 254, 4);
  ExpectReject(f, "payload.num_fds: count 254 exceeds the 253 limit");
  f = good;
  PutLe(f, H + 8, 4097, 4);
  ExpectReject(f, "payload.num_regions: count 4097 exceeds the 4096 limit");
  f = good;
  PutLe(f, H + 8, 0, 4);
  ExpectReject(f, "payload.num_regions");
  f = good;
  PutLe(f, H + 8, 3, 4);  // more regions than the payload holds
  ExpectReject(f, "payload.regions: count 3");
  f = good;
  PutLe(f, H + 12, 4, 4);
  ExpectReject(f, "payload.shard_index: 4 is not below shard_count 4");
  f = good;
  PutLe(f, H + 16, 0, 4);
  ExpectReject(f, "payload.shard_count: 0");
  f = good;
  PutLe(f, H + 16, KVF_PROTO_MAX_SHARDS + 1, 4);
  ExpectReject(f, "payload.shard_count: 65537 exceeds the 65536 limit");
  f = good;
  PutLe(f, H + 12, KVF_PROTO_MAX_SHARDS - 1, 4);
  PutLe(f, H + 16, KVF_PROTO_MAX_SHARDS, 4);
  kvf_proto_msg last;
  ASSERT_EQ(Decode(f, &last), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(last.u.reg.shard_index, KVF_PROTO_MAX_SHARDS - 1);
  kvf_proto_msg_clear(&last);
  {
    Register bad;
    bad.m.u.reg.shard_index = 4;
    uint8_t *buf = nullptr;
    size_t len = 0;
    EXPECT_EQ(kvf_proto_encode(&bad.m, &buf, &len), KVF_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(kvf_last_error()).find("register.shard_index: 4 is not below shard_count 4"),
              std::string::npos)
        << kvf_last_error();
  }
  f = good;
  PutLe(f, json_at, KVF_PROTO_MAX_GEOMETRY_JSON + 1, 4);
  ExpectReject(f, "payload.geometry_json: length");
  f = good;
  PutLe(f, json_at, 0xFFFFFF, 4);
  ExpectReject(f, "payload.geometry_json");
  f = good;
  f[json_at + 5] = 0;
  ExpectReject(f, "payload.geometry_json: NUL byte at offset 1");
  const size_t r1 = regions_at + 88;  // regions[1]
  f = good;
  PutLe(f, r1 + 52, 1, 4);
  ExpectReject(f, "payload.regions[1].reserved0");
  f = good;
  PutLe(f, r1 + 56, 1, 8);
  ExpectReject(f, "payload.regions[1].reserved1");
  // A region's wrong values are a well-formed frame: instance 0, provider
  // 3, an empty allocation or range, a descriptor past the frame's, a
  // region past its allocation (offset 2 MiB + 3 MiB > 4 MiB) or whose end
  // wraps 64 bits. The server refuses the request (KVF_ERR_INVALID_ARGUMENT,
  // KVF_ERR_PERMISSION for instance 0; test_server_isolation), keeping the
  // connection, where a decoder's refusal would close it; the decoder hands
  // the values on as sent.
  struct Value {
    size_t at, width;
    uint64_t value;
  } values[] = {{0, 8, 0}, {48, 4, 3}, {24, 8, 0}, {72, 8, 0}, {80, 4, 2}, {80, 4, UINT32_MAX}};
  for (const Value &v : values) {
    f = good;
    PutLe(f, r1 + v.at, v.value, (unsigned)v.width);
    kvf_proto_msg kept;
    ASSERT_EQ(Decode(f, &kept), KVF_SUCCESS) << "offset " << v.at << ": " << kvf_last_error();
    const kvf_proto_region &x = kept.u.reg.regions[1];
    uint64_t got = v.at == 0 ? x.instance_id : v.at == 48 ? x.provider : v.at == 24 ? x.size : v.at == 72 ? x.length
                                                                                                           : x.fd_index;
    EXPECT_EQ(got, v.value) << "offset " << v.at;
    kvf_proto_msg_clear(&kept);
  }
  for (uint64_t offset : {(uint64_t)2u << 20, (uint64_t)UINT64_MAX}) {
    f = good;
    PutLe(f, r1 + 64, offset, 8);
    PutLe(f, r1 + 72, (3u << 20), 8);
    kvf_proto_msg past;
    ASSERT_EQ(Decode(f, &past), KVF_SUCCESS) << kvf_last_error();
    EXPECT_EQ(past.u.reg.regions[1].offset, offset);
    EXPECT_EQ(past.u.reg.regions[1].length, 3u << 20);
    kvf_proto_msg_clear(&past);
  }
  f = good;
  PutLe(f, r1 + 84, 9, 4);
  ExpectReject(f, "payload.regions[1].reserved2");
  f = good;
  f.resize(f.size() - 30);
  FixLen(f);
  ExpectReject(f, "payload.regions: count 2");
}

// STORE payload offsets: registration_id 0, token_begin 8, token_end 16,
// format 24, ready_kind 28, ready_handle 32, num_chunk_keys 96, num_groups
// 100, chunk_keys 104.
TEST(Protocol, XferRejections) {
  Xfer in;
  std::vector<uint8_t> good = Encode(in.m);
  const size_t keys_at = H + 104, groups_at = keys_at + KVF_CHUNK_KEY_BYTES * in.keys.size();
  auto f = good;
  PutLe(f, H + 16, 256, 8);
  ExpectReject(f, "payload.token_end: 256 is not after token_begin 256");
  f = good;
  PutLe(f, H + 24, 2, 4);
  ExpectReject(f, "payload.format");
  f = good;
  PutLe(f, H + 28, 2, 4);
  ExpectReject(f, "payload.ready_kind: 2 is neither");
  f = good;
  memset(&f[H + 32], 0, KVF_PROTO_READY_HANDLE_BYTES);
  ExpectReject(f, "payload.ready_handle: all zero, but ready_kind 1");
  f = good;
  PutLe(f, H + 28, 0, 4);  // no event, but a handle
  ExpectReject(f, "payload.ready_handle: byte 0 is 0x01");
  f = good;
  PutLe(f, H + 96, 0, 4);
  ExpectReject(f, "payload.num_chunk_keys: 0");
  f = good;
  PutLe(f, H + 96, KVF_PROTO_MAX_CHUNKS + 1, 4);
  ExpectReject(f, "payload.num_chunk_keys: count 65537 exceeds the 65536 limit");
  f = good;
  PutLe(f, H + 16, 259, 8);  // 3 tokens cannot make 4 chunks
  ExpectReject(f, "payload.num_chunk_keys: 4 chunks for a range of 3 tokens");
  f = good;
  PutLe(f, H + 96, 200, 4);  // more keys than the payload holds
  ExpectReject(f, "payload.chunk_keys: count 200 needs at least 6400 bytes");
  f = good;
  memset(&f[keys_at + 32 * 3], 0, 32);
  ExpectReject(f, "payload.chunk_keys[3]: all zero is not a key");
  f = good;
  memset(&f[keys_at + 32 * 3], 0, 31);  // one nonzero byte makes a key
  kvf_proto_msg one;
  ASSERT_EQ(Decode(f, &one), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(one.u.xfer.chunk_keys[3].bytes[31], 32u);
  kvf_proto_msg_clear(&one);
  f = good;
  PutLe(f, H + 100, 65, 4);
  ExpectReject(f, "payload.num_groups: count 65 exceeds the 64 limit");
  f = good;
  PutLe(f, H + 100, 0, 4);
  ExpectReject(f, "payload.num_groups: 0");
  f = good;
  PutLe(f, H + 100, 60, 4);
  ExpectReject(f, "payload.groups: count 60");
  // groups[2].count: after groups[0] (12 + 5*4) and groups[1] (12 + 10*4), skip first_block.
  const size_t g2_count = groups_at + (12 + 20) + (12 + 40) + 8;
  f = good;
  PutLe(f, g2_count, KVF_PROTO_MAX_BLOCKS_PER_GROUP + 1, 4);
  ExpectReject(f, "payload.groups[2].block_ids: count 1048577 exceeds the 1048576 limit");
  f = good;
  PutLe(f, g2_count, 17, 4);  // the payload holds 16
  ExpectReject(f, "payload.groups[2].block_ids: count 17 needs at least 68 bytes");
  f = good;
  f.resize(f.size() - 1);
  FixLen(f);
  ExpectReject(f, "payload.groups[2].block_ids");
  f = good;
  f.push_back(0);
  FixLen(f);
  ExpectReject(f, "payload: 1 bytes left over after the STORE message");

  // A RETRIEVE waits for no event.
  Xfer rin(KVF_PROTO_RETRIEVE);
  std::vector<uint8_t> rgood = Encode(rin.m);
  f = rgood;
  PutLe(f, H + 28, 1, 4);
  f[H + 32] = 7;
  ExpectReject(f, "payload.ready_kind: 1, but a RETRIEVE waits for nothing");
  f = rgood;
  f[H + 32 + 63] = 7;
  ExpectReject(f, "payload.ready_handle: byte 63 is 0x07");
}

// Reply payload offsets: status 0, outcome 4, prefix_tokens 8, objects_done
// 16, objects_present 24, bytes_done 32, num_groups 40, num_object_groups 44,
// group_blocks 48.
TEST(Protocol, XferReplyRejections) {
  XferReply in;
  std::vector<uint8_t> good = Encode(in.m);
  auto f = good;
  PutLe(f, H, 99, 4);
  ExpectReject(f, "payload.status: 99 is not a kvf_status");
  f = good;
  PutLe(f, H, KVF_ERR_CUDA, 4);
  ExpectReject(f, "payload.status: 10, but the outcome is done");
  f = good;
  PutLe(f, H + 4, 2, 4);  // failed, with status 0
  ExpectReject(f, "payload.status: 0 (success), but the outcome is failed");
  for (uint32_t bad : {0u, 5u}) {
    f = good;
    PutLe(f, H + 4, bad, 4);
    ExpectReject(f, "payload.outcome: " + std::to_string(bad) + " is not");
  }
  f = good;
  PutLe(f, H + 24, 1, 8);
  ExpectReject(f, "payload.objects_present: 1, a RETRIEVE_REPLY carries 0");
  f = good;
  PutLe(f, H + 40, 65, 4);
  ExpectReject(f, "payload.num_groups: count 65 exceeds the 64 limit");
  f = good;
  PutLe(f, H + 44, 65, 4);
  ExpectReject(f, "payload.num_object_groups: count 65 exceeds the 64 limit");
  f = good;
  PutLe(f, H + 40, 4, 4);  // 4 + 2 u64 do not fit in 36 bytes
  ExpectReject(f, "payload.og_prefix_tokens: count 2 needs");
  f = good;
  PutLe(f, H + 40, 40, 4);
  ExpectReject(f, "payload.group_blocks: count 40 needs at least 320 bytes");
  f = good;
  PutLe(f, H + 48 + 32, 600, 4);  // the message's length
  ExpectReject(f, "payload.message: length 600 exceeds the 511 limit");
  f = good;
  f.push_back('x');
  PutLe(f, H + 48 + 32, 1, 4);
  FixLen(f);
  f.push_back(0);
  FixLen(f);
  ExpectReject(f, "payload: 1 bytes left over after the RETRIEVE_REPLY message");

  XferReply sin(KVF_PROTO_STORE_REPLY);
  std::vector<uint8_t> sgood = Encode(sin.m);
  f = sgood;
  PutLe(f, H + 44, 1, 4);
  f.insert(f.begin() + (long)(H + 48 + 16), 8, 0);  // room for one prefix
  FixLen(f);
  ExpectReject(f, "payload.num_object_groups: 1, a STORE_REPLY carries none");
}

TEST(Protocol, OtherRejections) {
  kvf_proto_msg s = Msg(KVF_PROTO_STAT);
  s.u.stat.flags = 1;
  auto f = Encode(s);
  PutLe(f, H, 6, 4);
  ExpectReject(f, "payload.flags");

  kvf_proto_msg u = Msg(KVF_PROTO_UNREGISTER_REPLY);
  u.u.unregister_reply = {3, 1};
  f = Encode(u);
  PutLe(f, H + 8, 5, 4);
  ExpectReject(f, "payload.state");
  f = Encode(u);
  PutLe(f, H + 12, 5, 4);
  ExpectReject(f, "payload.reserved");

  kvf_proto_msg e = Msg(KVF_PROTO_ERROR);
  e.u.error.status = KVF_ERR_BUSY;
  e.u.error.version = 1;
  strcpy(e.u.error.message, "busy");
  f = Encode(e);
  PutLe(f, H, 0, 4);
  ExpectReject(f, "payload.status");
  f = Encode(e);
  PutLe(f, H + 4, 0, 2);
  ExpectReject(f, "payload.version");
  f = Encode(e);
  PutLe(f, H + 8, 200, 4);  // field length over the limit
  ExpectReject(f, "payload.field");

  kvf_proto_msg r = Msg(KVF_PROTO_REGISTER_REPLY);
  r.u.register_reply = {0, 1, 2, 3};
  ExpectReject(Encode(r), "payload.registration_id");

  kvf_proto_stat_reply sr;
  memset(&sr, 0, sizeof sr);
  kvf_proto_msg st = Msg(KVF_PROTO_STAT_REPLY);
  st.u.stat_reply = sr;
  f = Encode(st);
  PutLe(f, H + 8 + 44 + 60, 1025, 4); // after the total and data counters
  ExpectReject(f, "payload.clients: count 1025 exceeds the 1024 limit");
  f = Encode(st);
  PutLe(f, H + 8 + 44 + 60, 2, 4);
  ExpectReject(f, "payload.clients: count 2 needs");
}

TEST(Protocol, EncoderRefusesWhatTheDecoderWould) {
  uint8_t *buf = nullptr;
  size_t len = 0;
  Xfer x;
  x.groups[1].count = KVF_PROTO_MAX_BLOCKS_PER_GROUP + 1;
  EXPECT_EQ(kvf_proto_encode(&x.m, &buf, &len), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvf_last_error()).find("groups[1].block_ids"), std::string::npos) << kvf_last_error();
  // The STORE/RETRIEVE rules, named as the caller's fields.
  struct Case {
    std::function<void(Xfer &)> edit;
    std::string field;
  };
  std::vector<Case> cases = {
      {[](Xfer &v) { memset(&v.keys[2], 0, sizeof v.keys[2]); }, "xfer.chunk_keys[2]: all zero is not a key"},
      {[](Xfer &v) { v.m.u.xfer.num_chunk_keys = 0; }, "xfer.num_chunk_keys: 0"},
      {[](Xfer &v) { v.m.u.xfer.num_chunk_keys = KVF_PROTO_MAX_CHUNKS + 1; }, "xfer.num_chunk_keys: count 65537"},
      {[](Xfer &v) { v.m.u.xfer.token_end = 258; }, "xfer.num_chunk_keys: 4 chunks for a range of 2 tokens"},
      {[](Xfer &v) { v.m.u.xfer.token_end = 100; }, "xfer.token_end"},
      {[](Xfer &v) { v.m.u.xfer.format = 3; }, "xfer.format"},
      {[](Xfer &v) { v.m.u.xfer.ready_kind = 0; }, "xfer.ready_handle: byte 0"},
      {[](Xfer &v) { memset(v.m.u.xfer.ready_handle, 0, sizeof v.m.u.xfer.ready_handle); }, "xfer.ready_handle: all zero"},
      {[](Xfer &v) { v.m.type = KVF_PROTO_RETRIEVE; }, "xfer.ready_kind: 1, but a RETRIEVE"},
      {[](Xfer &v) { v.m.u.xfer.num_groups = 0; }, "xfer.num_groups: 0"},
      {[](Xfer &v) { v.m.u.xfer.num_groups = 65; }, "xfer.num_groups: count 65"},
      {[](Xfer &v) { v.m.u.xfer.chunk_keys = nullptr; }, "xfer.chunk_keys: NULL"},
      {[](Xfer &v) { v.groups[0].block_ids = nullptr; }, "xfer.groups[0].block_ids: NULL"},
  };
  for (const Case &c : cases) {
    Xfer v;
    c.edit(v);
    EXPECT_EQ(kvf_proto_encode(&v.m, &buf, &len), KVF_ERR_INVALID_ARGUMENT) << c.field;
    EXPECT_NE(std::string(kvf_last_error()).find(c.field), std::string::npos) << kvf_last_error();
  }
  struct ReplyCase {
    std::function<void(XferReply &)> edit;
    std::string field;
  };
  std::vector<ReplyCase> rcases = {
      {[](XferReply &v) { v.m.u.xfer_reply.outcome = 2; }, "xfer_reply.status: 0 (success), but the outcome is failed"},
      {[](XferReply &v) { v.m.u.xfer_reply.status = KVF_ERR_IO; }, "xfer_reply.status: 7, but the outcome is done"},
      {[](XferReply &v) { v.m.u.xfer_reply.status = 21; }, "xfer_reply.status: 21"},
      {[](XferReply &v) { v.m.u.xfer_reply.outcome = 9; }, "xfer_reply.outcome: 9"},
      {[](XferReply &v) { v.m.u.xfer_reply.num_groups = 65; }, "xfer_reply.num_groups: count 65"},
      {[](XferReply &v) { v.m.u.xfer_reply.og_prefix_tokens = nullptr; }, "xfer_reply.og_prefix_tokens: NULL"},
      {[](XferReply &v) { v.m.u.xfer_reply.objects_present = 1; }, "xfer_reply.objects_present"},
      {[](XferReply &v) { v.m.type = KVF_PROTO_STORE_REPLY; }, "xfer_reply.num_object_groups: 2, a STORE_REPLY"},
      {[](XferReply &v) { memset(v.m.u.xfer_reply.message, 'm', sizeof v.m.u.xfer_reply.message); },
       "xfer_reply.message"},
  };
  for (const ReplyCase &c : rcases) {
    XferReply v;
    c.edit(v);
    EXPECT_EQ(kvf_proto_encode(&v.m, &buf, &len), KVF_ERR_INVALID_ARGUMENT) << c.field;
    EXPECT_NE(std::string(kvf_last_error()).find(c.field), std::string::npos) << kvf_last_error();
  }
  kvf_proto_msg bad = Msg(0x1234);
  EXPECT_EQ(kvf_proto_encode(&bad, &buf, &len), KVF_ERR_INVALID_ARGUMENT);
  kvf_proto_msg h = Hello();
  memset(h.u.hello.name, 'a', sizeof h.u.hello.name);  // no NUL
  EXPECT_EQ(kvf_proto_encode(&h, &buf, &len), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvf_last_error()).find("hello.name"), std::string::npos);
  EXPECT_EQ(buf, nullptr);
}

TEST(Protocol, ReaderReassemblesByteByByte) {
  Xfer x;
  std::vector<uint8_t> stream = Encode(Hello());
  std::vector<uint8_t> second = Encode(x.m);
  kvf_proto_msg hb = Msg(KVF_PROTO_UNREGISTER, 99);
  std::vector<uint8_t> third = Encode(hb);
  stream.insert(stream.end(), second.begin(), second.end());
  stream.insert(stream.end(), third.begin(), third.end());

  kvf_proto_reader r;
  kvf_proto_reader_init(&r, 0);
  std::vector<uint16_t> types;
  size_t frame_start = 0, pos = 0;
  std::vector<size_t> lens = {Encode(Hello()).size(), second.size(), third.size()};
  while (pos < stream.size()) {
    size_t want = kvf_proto_reader_want(&r);
    ASSERT_GT(want, 0u);
    size_t consumed = 0;
    int ready = 0;
    ASSERT_EQ(kvf_proto_reader_feed(&r, &stream[pos], 1, &consumed, &ready), KVF_SUCCESS) << kvf_last_error();
    ASSERT_EQ(consumed, 1u);
    pos++;
    if (!ready) continue;
    kvf_proto_header h;
    uint8_t *payload = nullptr;
    ASSERT_EQ(kvf_proto_reader_take(&r, &h, &payload), KVF_SUCCESS);
    EXPECT_EQ(pos - frame_start, lens[types.size()]);
    frame_start = pos;
    kvf_proto_msg m;
    ASSERT_EQ(kvf_proto_decode(&h, payload, &m), KVF_SUCCESS) << kvf_last_error();
    types.push_back(m.type);
    if (m.type == KVF_PROTO_STORE) {
      EXPECT_EQ(m.u.xfer.groups[2].block_ids[15], 0xFFFFFFFFu);
    }
    kvf_proto_msg_clear(&m);
    free(payload);
  }
  EXPECT_EQ(types, (std::vector<uint16_t>{KVF_PROTO_HELLO, KVF_PROTO_STORE, KVF_PROTO_UNREGISTER}));
  uint8_t *p = nullptr;
  kvf_proto_header h;
  EXPECT_EQ(kvf_proto_reader_take(&r, &h, &p), KVF_ERR_STATE);
  kvf_proto_reader_reset(&r);
}

TEST(Protocol, ReaderStopsAtFrameEndAndInPieces) {
  std::vector<uint8_t> a = Encode(Hello()), b = Encode(Hello());
  std::vector<uint8_t> s = a;
  s.insert(s.end(), b.begin(), b.end());
  kvf_proto_reader r;
  kvf_proto_reader_init(&r, 0);
  size_t consumed = 0;
  int ready = 0;
  ASSERT_EQ(kvf_proto_reader_feed(&r, s.data(), s.size(), &consumed, &ready), KVF_SUCCESS);
  EXPECT_EQ(consumed, a.size());  // never past the first frame
  EXPECT_EQ(ready, 1);
  EXPECT_EQ(kvf_proto_reader_want(&r), 0u);
  ASSERT_EQ(kvf_proto_reader_feed(&r, s.data() + consumed, 5, &consumed, &ready), KVF_SUCCESS);
  EXPECT_EQ(consumed, 0u);  // waits to be taken
  kvf_proto_header h;
  uint8_t *p = nullptr;
  ASSERT_EQ(kvf_proto_reader_take(&r, &h, &p), KVF_SUCCESS);
  free(p);
  // The second frame in pieces of 7 bytes.
  size_t pos = a.size();
  while (pos < s.size()) {
    size_t n = std::min<size_t>(7, s.size() - pos);
    ASSERT_EQ(kvf_proto_reader_feed(&r, &s[pos], n, &consumed, &ready), KVF_SUCCESS);
    pos += consumed;
  }
  EXPECT_EQ(ready, 1);
  ASSERT_EQ(kvf_proto_reader_take(&r, &h, &p), KVF_SUCCESS);
  EXPECT_EQ(h.type, KVF_PROTO_HELLO);
  free(p);
  kvf_proto_reader_reset(&r);
}

TEST(Protocol, ReaderRejectsOversizeBeforeAllocating) {
  kvf_proto_msg m = Hello();
  std::vector<uint8_t> f = Encode(m);
  PutLe(f, 16, 4096 + 1, 4);
  kvf_proto_reader r;
  kvf_proto_reader_init(&r, 4096);
  size_t consumed = 0;
  int ready = 0;
  EXPECT_EQ(kvf_proto_reader_feed(&r, f.data(), f.size(), &consumed, &ready), KVF_ERR_PROTOCOL);
  EXPECT_NE(std::string(kvf_last_error()).find("header.payload_len: 4097 bytes exceed the 4096-byte limit"),
            std::string::npos)
      << kvf_last_error();
  EXPECT_EQ(consumed, KVF_PROTO_HEADER_SIZE);
  EXPECT_EQ(r.payload, nullptr);  // nothing was allocated for it
  EXPECT_EQ(r.header.request_id, 42u);
  // Sticky: the stream is out of step.
  EXPECT_EQ(kvf_proto_reader_feed(&r, f.data(), 1, &consumed, &ready), KVF_ERR_PROTOCOL);
  EXPECT_EQ(consumed, 0u);
  kvf_proto_reader_reset(&r);
  // A 4 GiB length is refused the same way with the default limit.
  PutLe(f, 16, 0xFFFFFFFFu, 4);
  kvf_proto_reader_init(&r, 0);
  EXPECT_EQ(kvf_proto_reader_feed(&r, f.data(), f.size(), &consumed, &ready), KVF_ERR_PROTOCOL);
  EXPECT_EQ(r.payload, nullptr);
  kvf_proto_reader_reset(&r);
}

// A reader with a hold limit stops after the header of a larger frame,
// allocating nothing, until its owner grants the buffer; smaller frames
// pass as before, and new limits apply from the next header on.
TEST(Protocol, ReaderHoldsALargeFrameUntilGranted) {
  std::vector<uint8_t> small = Encode(Hello());
  const uint32_t hold = (uint32_t)(small.size() - KVF_PROTO_HEADER_SIZE);
  kvf_proto_reader r;
  kvf_proto_reader_init(&r, 0);
  kvf_proto_reader_limit(&r, 0, hold);
  size_t consumed = 0;
  int ready = 0;
  // At the limit: not held.
  ASSERT_EQ(kvf_proto_reader_feed(&r, small.data(), small.size(), &consumed, &ready), KVF_SUCCESS);
  EXPECT_EQ(ready, 1);
  EXPECT_EQ(kvf_proto_reader_held(&r), 0u);
  kvf_proto_header h;
  uint8_t *p = nullptr;
  ASSERT_EQ(kvf_proto_reader_take(&r, &h, &p), KVF_SUCCESS);
  free(p);
  // One byte over it: held after the header, nothing allocated or consumed.
  std::vector<uint8_t> big = small;
  big.push_back(0);
  FixLen(big);
  ASSERT_EQ(kvf_proto_reader_feed(&r, big.data(), big.size(), &consumed, &ready), KVF_SUCCESS);
  EXPECT_EQ(consumed, KVF_PROTO_HEADER_SIZE);
  EXPECT_EQ(ready, 0);
  EXPECT_EQ(kvf_proto_reader_held(&r), hold + 1);
  EXPECT_EQ(r.payload, nullptr);
  EXPECT_EQ(kvf_proto_reader_want(&r), 0u);
  ASSERT_EQ(kvf_proto_reader_feed(&r, big.data() + consumed, 5, &consumed, &ready), KVF_SUCCESS);
  EXPECT_EQ(consumed, 0u);  // still held
  ASSERT_EQ(kvf_proto_reader_grant(&r), KVF_SUCCESS);
  EXPECT_EQ(kvf_proto_reader_grant(&r), KVF_ERR_STATE);  // nothing held any more
  EXPECT_EQ(kvf_proto_reader_want(&r), (size_t)hold + 1);
  ASSERT_EQ(kvf_proto_reader_feed(&r, big.data() + KVF_PROTO_HEADER_SIZE, big.size() - KVF_PROTO_HEADER_SIZE,
                                  &consumed, &ready),
            KVF_SUCCESS);
  EXPECT_EQ(ready, 1);
  ASSERT_EQ(kvf_proto_reader_take(&r, &h, &p), KVF_SUCCESS);
  EXPECT_EQ(h.payload_len, hold + 1);
  free(p);
  // A held empty-payload frame cannot exist: an empty payload is never over
  // the limit. A lower max_payload refuses what was held before.
  kvf_proto_reader_limit(&r, hold, 0);
  EXPECT_EQ(kvf_proto_reader_feed(&r, big.data(), big.size(), &consumed, &ready), KVF_ERR_PROTOCOL);
  EXPECT_NE(strstr(kvf_last_error(), "header.payload_len"), nullptr) << kvf_last_error();
  EXPECT_EQ(kvf_proto_reader_held(&r), 0u);
  kvf_proto_reader_reset(&r);
  EXPECT_EQ(r.max_payload, hold);  // reset keeps the limits
}

TEST(Protocol, ReaderRejectsGarbageAndWrongVersion) {
  std::vector<uint8_t> garbage(64, 0x5A);
  kvf_proto_reader r;
  kvf_proto_reader_init(&r, 0);
  size_t consumed = 0;
  int ready = 0;
  EXPECT_EQ(kvf_proto_reader_feed(&r, garbage.data(), garbage.size(), &consumed, &ready), KVF_ERR_PROTOCOL);
  EXPECT_NE(std::string(kvf_last_error()).find("header.magic"), std::string::npos);
  kvf_proto_reader_reset(&r);
  std::vector<uint8_t> f = Encode(Hello());
  PutLe(f, 4, 1, 2);
  EXPECT_EQ(kvf_proto_reader_feed(&r, f.data(), f.size(), &consumed, &ready), KVF_ERR_PROTOCOL);
  EXPECT_NE(std::string(kvf_last_error()).find("peer speaks protocol version 1, this side speaks 2"),
            std::string::npos)
      << kvf_last_error();
  kvf_proto_reader_reset(&r);
}

TEST(Protocol, EveryTruncationOfEveryMessageIsRejected) {
  Register reg;
  Xfer x;
  kvf_proto_msg hr = Msg(KVF_PROTO_HELLO_REPLY);
  hr.u.hello_reply = {1, 99, 1, 17, 1000, 5000, 65536};
  Xfer rx(KVF_PROTO_RETRIEVE);
  XferReply sr(KVF_PROTO_STORE_REPLY), rr(KVF_PROTO_RETRIEVE_REPLY);
  strcpy(sr.m.u.xfer_reply.message, "m");
  std::vector<std::vector<uint8_t>> frames = {Encode(Hello()), Encode(reg.m), Encode(x.m), Encode(rx.m),
                                              Encode(hr),      Encode(sr.m),  Encode(rr.m)};
  for (const auto &good : frames) {
    for (size_t cut = 0; cut < good.size() - H; cut++) {
      auto f = good;
      f.resize(H + cut);
      FixLen(f);
      kvf_proto_msg m;
      EXPECT_EQ(Decode(f, &m), KVF_ERR_PROTOCOL) << "cut at " << cut;
      EXPECT_NE(std::string(kvf_last_error()).find("payload"), std::string::npos) << kvf_last_error();
    }
  }
}

// The limits hold exactly: the largest count decodes, one more is refused by
// both sides, and a request over the payload limit is refused by the encoder.
TEST(Protocol, XferLimitsAreExact) {
  std::vector<kvf_chunk_key> keys(KVF_PROTO_MAX_CHUNKS);
  for (size_t i = 0; i < keys.size(); i++) {
    memset(&keys[i], 0, sizeof keys[i]);
    uint64_t v = i + 1;
    memcpy(keys[i].bytes, &v, sizeof v);
  }
  std::vector<uint32_t> ids(KVF_PROTO_MAX_BLOCKS_PER_GROUP);
  for (size_t i = 0; i < ids.size(); i++) ids[i] = (uint32_t)i;
  std::vector<kvf_proto_group> groups(KVF_PROTO_MAX_GROUPS);
  memset(groups.data(), 0, groups.size() * sizeof groups[0]);
  groups[5].block_ids = ids.data();
  groups[5].count = (uint32_t)ids.size();
  kvf_proto_msg m = Msg(KVF_PROTO_RETRIEVE);
  m.u.xfer.token_begin = 0;
  m.u.xfer.token_end = (uint64_t)KVF_PROTO_MAX_CHUNKS * 16;
  m.u.xfer.chunk_keys = keys.data();
  m.u.xfer.num_chunk_keys = KVF_PROTO_MAX_CHUNKS;
  m.u.xfer.groups = groups.data();
  m.u.xfer.num_groups = KVF_PROTO_MAX_GROUPS;
  std::vector<uint8_t> f = Encode(m);
  kvf_proto_msg out;
  ASSERT_EQ(Decode(f, &out), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(out.u.xfer.num_chunk_keys, KVF_PROTO_MAX_CHUNKS);
  EXPECT_EQ(0, memcmp(&out.u.xfer.chunk_keys[KVF_PROTO_MAX_CHUNKS - 1], &keys.back(), KVF_CHUNK_KEY_BYTES));
  ASSERT_EQ(out.u.xfer.groups[5].count, KVF_PROTO_MAX_BLOCKS_PER_GROUP);
  EXPECT_EQ(out.u.xfer.groups[5].block_ids[KVF_PROTO_MAX_BLOCKS_PER_GROUP - 1], KVF_PROTO_MAX_BLOCKS_PER_GROUP - 1);
  EXPECT_EQ(out.u.xfer.groups[4].count, 0u);
  kvf_proto_msg_clear(&out);

  uint8_t *buf = nullptr;
  size_t len = 0;
  groups[5].count++;
  ids.push_back(0);
  groups[5].block_ids = ids.data();
  EXPECT_EQ(kvf_proto_encode(&m, &buf, &len), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvf_last_error()).find("xfer.groups[5].block_ids: count 1048577 exceeds the 1048576 limit"),
            std::string::npos)
      << kvf_last_error();
  groups[5].count--;
  // Four full groups are 16 MiB of block ids: over the payload limit.
  for (int g = 0; g < 4; g++) {
    groups[g].block_ids = ids.data();
    groups[g].count = KVF_PROTO_MAX_BLOCKS_PER_GROUP;
  }
  EXPECT_EQ(kvf_proto_encode(&m, &buf, &len), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvf_last_error()).find("payload:"), std::string::npos) << kvf_last_error();
  EXPECT_EQ(buf, nullptr);
}

// ---- LOOKUP, UNPIN and the RETIRED notice ------------------------------------

namespace {

// A LOOKUP of 3 chunks [512, 1000) with a pin; the keys live in `keys`.
struct Lookup {
  std::vector<kvf_proto_chunk_key> keys = {Key(0x11), Key(0x55), Key(3)};
  kvf_proto_msg m;
  Lookup() {
    m = Msg(KVF_PROTO_LOOKUP, 11);
    m.u.lookup.registration_id = 9;
    m.u.lookup.token_begin = 512;
    m.u.lookup.token_end = 1000;
    m.u.lookup.format = 1;
    m.u.lookup.pin_ms = KVF_PROTO_MAX_PIN_MS;
    m.u.lookup.chunk_keys = keys.data();
    m.u.lookup.num_chunk_keys = (uint32_t)keys.size();
  }
};

struct LookupReply {
  uint64_t og_prefix[3] = {1000, 768, 512};
  kvf_proto_msg m;
  LookupReply() {
    m = Msg(KVF_PROTO_LOOKUP_REPLY, 11);
    m.u.lookup_reply.prefix_tokens = 768;
    m.u.lookup_reply.pin_id = 5;
    m.u.lookup_reply.pinned_chunks = 1;
    m.u.lookup_reply.og_prefix_tokens = og_prefix;
    m.u.lookup_reply.num_object_groups = 3;
  }
};

// LOOKUP payload offsets (docs/protocol.md).
constexpr size_t kLookupPinMs = H + 28, kLookupKeys = H + 32, kLookupReserved = H + 36, kLookupKey0 = H + 40;

}  // namespace

TEST(Protocol, RoundTripLookupUnpinAndRetired) {
  Lookup q;
  std::vector<uint8_t> f = Encode(q.m);
  ASSERT_EQ(f.size(), H + 40 + KVF_PROTO_KEY_BYTES * q.keys.size()); // the layout of docs/protocol.md
  kvf_proto_msg d;
  ASSERT_EQ(Decode(f, &d), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(d.type, KVF_PROTO_LOOKUP);
  EXPECT_EQ(d.request_id, 11u);
  EXPECT_EQ(d.u.lookup.registration_id, 9u);
  EXPECT_EQ(d.u.lookup.token_begin, 512u);
  EXPECT_EQ(d.u.lookup.token_end, 1000u);
  EXPECT_EQ(d.u.lookup.format, 1u);
  EXPECT_EQ(d.u.lookup.pin_ms, KVF_PROTO_MAX_PIN_MS);
  ASSERT_EQ(d.u.lookup.num_chunk_keys, 3u);
  for (uint32_t k = 0; k < 3; k++) EXPECT_EQ(memcmp(&d.u.lookup.chunk_keys[k], &q.keys[k], KVF_PROTO_KEY_BYTES), 0);
  kvf_proto_msg_clear(&d);

  LookupReply r;
  f = Encode(r.m);
  ASSERT_EQ(f.size(), H + 24 + 8 * 3);
  ASSERT_EQ(Decode(f, &d), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(d.type, KVF_PROTO_LOOKUP_REPLY);
  EXPECT_EQ(d.u.lookup_reply.prefix_tokens, 768u);
  EXPECT_EQ(d.u.lookup_reply.pin_id, 5u);
  EXPECT_EQ(d.u.lookup_reply.pinned_chunks, 1u);
  ASSERT_EQ(d.u.lookup_reply.num_object_groups, 3u);
  for (uint32_t i = 0; i < 3; i++) EXPECT_EQ(d.u.lookup_reply.og_prefix_tokens[i], r.og_prefix[i]);
  kvf_proto_msg_clear(&d);

  kvf_proto_msg u = Msg(KVF_PROTO_UNPIN, 12);
  u.u.unpin.pin_id = 5;
  f = Encode(u);
  ASSERT_EQ(f.size(), H + 8);
  ASSERT_EQ(Decode(f, &d), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(d.u.unpin.pin_id, 5u);
  kvf_proto_msg ur = Msg(KVF_PROTO_UNPIN_REPLY, 12);
  ur.u.unpin_reply.pin_id = 5;
  ur.u.unpin_reply.released = 1;
  f = Encode(ur);
  ASSERT_EQ(f.size(), H + 16);
  ASSERT_EQ(Decode(f, &d), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(d.u.unpin_reply.pin_id, 5u);
  EXPECT_EQ(d.u.unpin_reply.released, 1u);

  kvf_proto_msg rt = Msg(KVF_PROTO_RETIRED, 77);
  rt.u.retired.outcome = 4;
  f = Encode(rt);
  ASSERT_EQ(f.size(), H + 8);
  ASSERT_EQ(Decode(f, &d), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(d.type, KVF_PROTO_RETIRED);
  EXPECT_EQ(d.request_id, 77u);
  EXPECT_EQ(d.u.retired.outcome, 4u);
  EXPECT_STREQ(kvf_proto_type_name(KVF_PROTO_RETIRED), "RETIRED");
  EXPECT_STREQ(kvf_proto_type_name(KVF_PROTO_LOOKUP), "LOOKUP");
  EXPECT_STREQ(kvf_proto_type_name(KVF_PROTO_UNPIN_REPLY), "UNPIN_REPLY");
  // A notice has the reply bit: a server refuses it from a client as it
  // refuses every server-to-client type.
  EXPECT_TRUE(KVF_PROTO_RETIRED & KVF_PROTO_REPLY);
}

// ---- PUSH ---------------------------------------------------------------------

namespace {

// A PUSH of 2 chunks [0, 128) to a peer named by address.
struct Push {
  std::vector<kvf_proto_chunk_key> keys = {Key(0x21), Key(0x42)};
  kvf_proto_msg m;
  Push() {
    m = Msg(KVF_PROTO_PUSH, 13);
    m.u.push.registration_id = 4;
    m.u.push.token_begin = 0;
    m.u.push.token_end = 128;
    m.u.push.format = 0;
    snprintf(m.u.push.peer, sizeof m.u.push.peer, "%s", "10.0.0.2:7400");
    m.u.push.chunk_keys = keys.data();
    m.u.push.num_chunk_keys = (uint32_t)keys.size();
  }
};

// PUSH payload offsets (docs/protocol.md): u64 registration_id, token_begin,
// token_end, u32 format, num_chunk_keys, then the peer (u32 length, bytes), keys.
constexpr size_t kPushKeys = H + 28, kPushPeerLen = H + 32, kPushPeer = H + 36;

}  // namespace

TEST(Protocol, RoundTripPush) {
  Push q;
  auto f = Encode(q.m);
  ASSERT_EQ(f.size(), H + 36 + 13 + 2 * KVF_PROTO_KEY_BYTES);
  kvf_proto_msg d;
  ASSERT_EQ(Decode(f, &d), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(d.type, KVF_PROTO_PUSH);
  EXPECT_EQ(d.u.push.registration_id, 4u);
  EXPECT_EQ(d.u.push.token_end, 128u);
  EXPECT_STREQ(d.u.push.peer, "10.0.0.2:7400");
  ASSERT_EQ(d.u.push.num_chunk_keys, 2u);
  EXPECT_EQ(memcmp(&d.u.push.chunk_keys[1], &q.keys[1], KVF_PROTO_KEY_BYTES), 0);
  kvf_proto_msg_clear(&d);
  kvf_proto_msg r = Msg(KVF_PROTO_PUSH_REPLY, 13);
  r.u.push_reply.objects_pushed = 3;
  r.u.push_reply.objects_present = 1;
  r.u.push_reply.objects_missing = 2;
  r.u.push_reply.objects_failed = 4;
  r.u.push_reply.bytes_pushed = 4096;
  r.u.push_reply.chunks_on_peer = 1;
  f = Encode(r);
  ASSERT_EQ(f.size(), H + 48);
  ASSERT_EQ(Decode(f, &d), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(d.type, KVF_PROTO_PUSH_REPLY);
  EXPECT_EQ(d.u.push_reply.objects_pushed, 3u);
  EXPECT_EQ(d.u.push_reply.objects_present, 1u);
  EXPECT_EQ(d.u.push_reply.objects_missing, 2u);
  EXPECT_EQ(d.u.push_reply.objects_failed, 4u);
  EXPECT_EQ(d.u.push_reply.bytes_pushed, 4096u);
  EXPECT_EQ(d.u.push_reply.chunks_on_peer, 1u);
  EXPECT_STREQ(kvf_proto_type_name(KVF_PROTO_PUSH), "PUSH");
  EXPECT_STREQ(kvf_proto_type_name(KVF_PROTO_PUSH_REPLY), "PUSH_REPLY");
}

TEST(Protocol, PushRejectionsNameTheirField) {
  Push q;
  const std::vector<uint8_t> good = Encode(q.m);
  auto f = good;
  PutLe(f, kPushKeys, 0, 4);
  ExpectReject(f, "payload.num_chunk_keys: 0");
  f = good;
  PutLe(f, kPushKeys, 200, 4);
  ExpectReject(f, "payload.num_chunk_keys: 200 chunks for a range of 128 tokens");
  f = good;
  PutLe(f, kPushPeerLen, 64, 4);
  ExpectReject(f, "payload.peer: length 64 exceeds the 63 limit");
  f = good;
  f[kPushPeer + 2] = ' ';
  ExpectReject(f, "payload.peer: byte 0x20 at 2");
  f = good;
  f[kPushPeer + 2] = 0;
  ExpectReject(f, "payload.peer: NUL byte");
  f = good;
  PutLe(f, H + 16, 0, 8);
  ExpectReject(f, "payload.token_end");
  f = good;
  f.push_back(0);
  FixLen(f);
  ExpectReject(f, "left over after the PUSH message");
  kvf_proto_msg r = Msg(KVF_PROTO_PUSH_REPLY);
  r.u.push_reply.objects_pushed = 1;
  r.u.push_reply.bytes_pushed = 10;
  f = Encode(r);
  PutLe(f, H, 0, 8);
  ExpectReject(f, "payload.bytes_pushed: 10 bytes for 0 objects");
  for (const auto &g : {good, Encode(r)})
    for (size_t cut = 0; cut < g.size() - H; cut++) {
      auto t = g;
      t.resize(H + cut);
      FixLen(t);
      kvf_proto_msg m;
      EXPECT_NE(Decode(t, &m), KVF_SUCCESS) << "a cut at " << cut << " decoded";
    }
  uint8_t *buf = nullptr;
  size_t len = 0;
  Push empty;
  empty.m.u.push.peer[0] = 0;
  EXPECT_EQ(kvf_proto_encode(&empty.m, &buf, &len), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvf_last_error()).find("push.peer: empty"), std::string::npos) << kvf_last_error();
  Push spaced;
  spaced.m.u.push.peer[3] = '\n';
  EXPECT_EQ(kvf_proto_encode(&spaced.m, &buf, &len), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvf_last_error()).find("push.peer: byte 0x0a at 3"), std::string::npos) << kvf_last_error();
}

TEST(Protocol, LookupRejectionsNameTheirField) {
  Lookup q;
  const std::vector<uint8_t> good = Encode(q.m);
  auto f = good;
  PutLe(f, kLookupPinMs, KVF_PROTO_MAX_PIN_MS + 1, 4);
  ExpectReject(f, "payload.pin_ms: 60001 exceeds the 60000 ms limit");
  f = good;
  PutLe(f, kLookupKeys, 0, 4);
  ExpectReject(f, "payload.num_chunk_keys: 0");
  f = good;
  PutLe(f, kLookupKeys, KVF_PROTO_MAX_CHUNKS + 1, 4);
  ExpectReject(f, "payload.num_chunk_keys: count 65537 exceeds the 65536 limit");
  f = good;
  PutLe(f, kLookupKeys, 4, 4);
  ExpectReject(f, "payload.chunk_keys: count 4 needs at least 128 bytes");
  f = good;
  PutLe(f, kLookupReserved, 1, 4);
  ExpectReject(f, "payload.reserved");
  f = good;
  for (unsigned b = 0; b < KVF_PROTO_KEY_BYTES; b++) f[kLookupKey0 + KVF_PROTO_KEY_BYTES + b] = 0;
  ExpectReject(f, "payload.chunk_keys[1]: all zero is not a key");
  f = good;
  PutLe(f, H + 16, 512, 8); // token_end = token_begin
  ExpectReject(f, "payload.token_end");
  f = good;
  PutLe(f, H + 24, 2, 4);
  ExpectReject(f, "payload.format");
  f = good;
  f.push_back(0);
  FixLen(f);
  ExpectReject(f, "left over after the LOOKUP message");

  LookupReply r;
  const std::vector<uint8_t> rgood = Encode(r.m);
  f = rgood;
  PutLe(f, H + 16, 0, 4); // pinned_chunks 0 with a pin id
  ExpectReject(f, "payload.pinned_chunks");
  f = rgood;
  PutLe(f, H + 20, KVF_PROTO_MAX_GROUPS + 1, 4);
  ExpectReject(f, "payload.num_object_groups");

  kvf_proto_msg u = Msg(KVF_PROTO_UNPIN);
  u.u.unpin.pin_id = 1;
  f = Encode(u);
  PutLe(f, H, 0, 8);
  ExpectReject(f, "payload.pin_id: 0 is not a pin");
  kvf_proto_msg ur = Msg(KVF_PROTO_UNPIN_REPLY);
  ur.u.unpin_reply.pin_id = 1;
  f = Encode(ur);
  PutLe(f, H + 8, 2, 4);
  ExpectReject(f, "payload.released");
  kvf_proto_msg rt = Msg(KVF_PROTO_RETIRED);
  rt.u.retired.outcome = 3;
  f = Encode(rt);
  PutLe(f, H, 1, 4);
  ExpectReject(f, "payload.outcome: 1 is neither 3 (cancelled) nor 4 (timed out)");
  f = Encode(rt);
  PutLe(f, H + 4, 1, 4);
  ExpectReject(f, "payload.reserved");

  // The encoder refuses what the decoder would, naming the field its way.
  uint8_t *buf = nullptr;
  size_t len = 0;
  Lookup bad;
  bad.m.u.lookup.pin_ms = KVF_PROTO_MAX_PIN_MS + 1;
  EXPECT_EQ(kvf_proto_encode(&bad.m, &buf, &len), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvf_last_error()).find("lookup.pin_ms"), std::string::npos) << kvf_last_error();
  Lookup zero;
  memset(&zero.keys[2], 0, sizeof zero.keys[2]);
  EXPECT_EQ(kvf_proto_encode(&zero.m, &buf, &len), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvf_last_error()).find("lookup.chunk_keys[2]: all zero is not a key"), std::string::npos);
  LookupReply inc;
  inc.m.u.lookup_reply.pin_id = 0;
  EXPECT_EQ(kvf_proto_encode(&inc.m, &buf, &len), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvf_last_error()).find("lookup_reply.pinned_chunks"), std::string::npos);
  rt.u.retired.outcome = 1;
  EXPECT_EQ(kvf_proto_encode(&rt, &buf, &len), KVF_ERR_INVALID_ARGUMENT);
  u.u.unpin.pin_id = 0;
  EXPECT_EQ(kvf_proto_encode(&u, &buf, &len), KVF_ERR_INVALID_ARGUMENT);

  // Every truncation is refused.
  kvf_proto_msg ok_rt = Msg(KVF_PROTO_RETIRED);
  ok_rt.u.retired.outcome = 4;
  kvf_proto_msg ok_u = Msg(KVF_PROTO_UNPIN);
  ok_u.u.unpin.pin_id = 3;
  for (const auto &g : {good, rgood, Encode(ok_rt), Encode(ok_u)})
    for (size_t cut = 0; cut < g.size() - H; cut++) {
      auto t = g;
      t.resize(H + cut);
      FixLen(t);
      kvf_proto_msg m;
      EXPECT_EQ(Decode(t, &m), KVF_ERR_PROTOCOL) << "cut at " << cut;
    }
}
