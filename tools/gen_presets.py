#!/usr/bin/env python3
"""Generate geometry/presets/*.json: kvferry geometry files for real engine layouts.

Every stride is derived from the engine's tensor shape (its logical dimensions
and the physical order the backend stores them in), so no byte count in a
preset is typed by hand. Each preset's description names the model
configuration and the layout it mirrors.

Usage:
  tools/gen_presets.py              write the presets into geometry/presets/
  tools/gen_presets.py --out DIR    write them into DIR
  tools/gen_presets.py --check      exit 1 if a committed preset differs from
                                    what this script generates (CI)
  tools/gen_presets.py --summary    print each preset's sizes

Output is deterministic: keys in a fixed order, two-space indentation, a
trailing newline. Python 3 standard library only.
"""

import argparse
import json
import os
import sys

BF16 = 2
FP8 = 1
NUM_BLOCKS = 32  # modest: tests and tools override it (num_blocks_override)
# plane_stride of a layout with K/V outermost ((2, num_blocks, ...)): the
# loader computes it from the group's num_blocks, after any override.
BLOCKS_EXPR = "num_blocks * block_stride"
CHUNK_TOKENS = 256


# ---- shapes -----------------------------------------------------------------

class Shape:
    """A tensor of named dimensions stored row-major in `order` (outermost
    first). Strides come out in bytes."""

    def __init__(self, dims, order, elem_bytes):
        assert sorted(dims) == sorted(order), (dims, order)
        self.dims = dict(dims)
        self.order = list(order)
        self.elem_bytes = elem_bytes

    def stride(self, name):
        """Byte stride of dimension `name` in the physical order."""
        step = self.elem_bytes
        for dim in reversed(self.order):
            if dim == name:
                return step
            step *= self.dims[dim]
        raise KeyError(name)

    def nbytes(self):
        total = self.elem_bytes
        for dim in self.order:
            total *= self.dims[dim]
        return total

    def text(self):
        return "[" + ", ".join("%s=%d" % (d, self.dims[d]) for d in self.order) + "]"


def attention_layer(shape, count, region, region_step=0, offset=0, offset_step=0,
                    head_bytes=None, heads=None, alias=None, block_stride=None, name="layer"):
    """One compact layers entry for an attention view read off `shape`, whose
    dimensions are NB (blocks), P (K/V planes, optional), T (tokens in a
    block), H (heads, optional) and R (one head row of elements). A
    block_stride given explicitly is a padded page holding one block."""
    planes = shape.dims.get("P", 1)
    if heads is None:
        heads = shape.dims.get("H", 1)
    if head_bytes is None:
        head_bytes = shape.dims["R"] * shape.elem_bytes
    entry = {"count": count, "name": name, "region": region}
    if region_step:
        entry["region_step"] = region_step
    entry["offset"] = offset
    if offset_step:
        entry["offset_step"] = offset_step
    entry["elem_bytes"] = shape.elem_bytes
    if block_stride is None:
        block_stride = shape.stride("NB")
    assert block_stride >= shape.stride("NB")
    entry["block_stride"] = block_stride
    entry["planes"] = planes
    entry["heads"] = heads
    entry["head_bytes"] = head_bytes
    if planes == 2:
        stride = shape.stride("P")
        if shape.order[0] == "P":
            # K and V outermost: the planes are a whole block pool apart, and
            # the pool size is the engine's run-time choice, so say so.
            assert stride == shape.dims["NB"] * block_stride, (stride, block_stride)
            stride = BLOCKS_EXPR
        entry["plane_stride"] = stride
    entry["token_stride"] = shape.stride("T")
    if heads > 1:
        entry["head_stride"] = shape.stride("H")
    if alias is not None:
        entry["alias_of"] = alias
    return entry


def recurrent_layer(count, region, region_step, slot_stride, states, elem_bytes, alias=None,
                    name="layer"):
    """A recurrent layers entry: `states` is a list of byte sizes laid back to
    back from the slot start (vLLM's mamba state views), slots `slot_stride`
    bytes apart."""
    out = []
    pos = 0
    for nbytes in states:
        out.append({"offset": pos, "bytes": nbytes})
        pos += nbytes
    assert pos <= slot_stride, (pos, slot_stride)
    entry = {"count": count, "name": name, "region": region}
    if region_step:
        entry["region_step"] = region_step
    entry["offset"] = 0
    entry["elem_bytes"] = elem_bytes
    entry["block_stride"] = slot_stride
    entry["states"] = out
    if alias is not None:
        entry["alias_of"] = alias
    return entry


def region(name, count=1, size=0):
    out = {"name": name}
    if count != 1:
        out["count"] = count
    out["size"] = size
    return out


def group(name, kind, block_size, layers, window=None):
    out = {"name": name, "kind": kind}
    if kind != "recurrent":
        out["block_size"] = block_size
    out["num_blocks"] = NUM_BLOCKS
    if window is not None:
        out["window"] = window
    out["layers"] = layers
    return out


def preset(name, description, regions, groups, chunk_tokens=CHUNK_TOKENS,
           separate_recurrent=None, dcp=None):
    out = {
        "format": "kvferry-geometry",
        "version": 1,
        "name": name,
        "description": description,
        "regions": regions,
        "groups": groups,
    }
    objects = {"chunk_tokens": chunk_tokens, "format": "canonical"}
    if separate_recurrent is not None:
        objects["separate_recurrent"] = separate_recurrent
    out["objects"] = objects
    if dcp is not None:
        out["dcp"] = {"world": dcp[0], "rank": dcp[1]}
    return out


def round_up(value, multiple):
    return (value + multiple - 1) // multiple * multiple


# ---- Llama 3.1 8B (32 layers, 8 KV heads, head_dim 128, bf16, block 16) -----

LLAMA8B = {"layers": 32, "kv_heads": 8, "head_dim": 128, "block": 16}
LLAMA8B_TEXT = ("Llama 3.1 8B: 32 layers, 8 KV heads, head_dim 128, bf16, block_size 16")


def llama8b_per_layer(name, engine, order, logical):
    L, H, D, BS = (LLAMA8B[k] for k in ("layers", "kv_heads", "head_dim", "block"))
    dims = {"P": 2, "NB": NUM_BLOCKS, "T": BS, "H": H, "R": D}
    shape = Shape(dims, order, BF16)
    note = ""
    if order[0] == "P":
        note = (" K and V are the outermost dimension, so plane_stride is \"num_blocks * "
                "block_stride\": the loader computes it from num_blocks (after any "
                "num_blocks_override), so the planes follow the engine's pool size.")
    desc = ("%s. %s: one tensor per layer (one region each), logical shape %s, physical "
            "order %s (NB = num_blocks, P = K/V, T = block_size, H = KV heads, R = head_dim "
            "elements).%s" % (LLAMA8B_TEXT, engine, logical, shape.text(), note))
    return preset(name, desc, [region("kv", count=L)],
                  [group("full", "full", BS, [attention_layer(shape, L, "kv", region_step=1)])])


def llama8b_crosslayer(name, engine, order, logical):
    L, H, D, BS = (LLAMA8B[k] for k in ("layers", "kv_heads", "head_dim", "block"))
    dims = {"NB": NUM_BLOCKS, "L": L, "P": 2, "T": BS, "H": H, "R": D}
    shape = Shape(dims, order, BF16)
    layer = attention_layer(shape, L, "kv", offset_step=shape.stride("L"))
    desc = ("%s. %s: one cross-layer tensor for all layers (one region), logical shape %s, "
            "physical order %s (L = layers); layer l starts l * %d bytes into the region." %
            (LLAMA8B_TEXT, engine, logical, shape.text(), shape.stride("L")))
    return preset(name, desc, [region("kv")], [group("full", "full", BS, [layer])])


def llama8b_fp8_inline_scales():
    L, H, D, BS = (LLAMA8B[k] for k in ("layers", "kv_heads", "head_dim", "block"))
    scale_bytes = 4
    row = D * FP8 + scale_bytes  # 132: not a multiple of 16
    dims = {"P": 2, "NB": NUM_BLOCKS, "T": BS, "H": H, "R": row}
    shape = Shape(dims, ["P", "NB", "T", "H", "R"], FP8)
    desc = ("Llama 3.1 8B: 32 layers, 8 KV heads, head_dim 128, fp8 KV cache with per-token-head "
            "quantisation, block_size 16. vLLM FlashAttention NHD, one tensor per layer, "
            "logical shape (2, num_blocks, block_size, num_kv_heads, %d) uint8, physical "
            "order %s: each head row is %d fp8 bytes followed by its %d-byte float scale "
            "(%d-byte rows, not 16-byte aligned), elem_bytes 1. plane_stride is \"num_blocks * "
            "block_stride\": it follows num_blocks (and any num_blocks_override)." %
            (row, shape.text(), D, scale_bytes, row))
    return preset("llama-3.1-8b-fp8-inline-scales", desc, [region("kv", count=L)],
                  [group("full", "full", BS, [attention_layer(shape, L, "kv", region_step=1)])])


# ---- DeepSeek V3 MLA (61 layers, one latent "head") ----------------------------

DSV3_LAYERS = 61
MLA_BLOCK = 64  # FlashMLA's block size


def deepseek_mla_bf16(name="deepseek-v3-mla-bf16", dcp=None):
    row = 512 + 64  # kv_lora_rank + qk_rope_head_dim
    shape = Shape({"NB": NUM_BLOCKS, "T": MLA_BLOCK, "R": row}, ["NB", "T", "R"], BF16)
    desc = ("DeepSeek V3: 61 layers, MLA latent cache of 512 latent + 64 rope = 576 bf16 "
            "elements per token (one %d-byte row, planes 1, heads 1), block_size %d. vLLM MLA "
            "(FlashMLA), one tensor per layer (one region each), logical shape (num_blocks, "
            "block_size, 576), physical order %s." % (row * BF16, MLA_BLOCK, shape.text()))
    if dcp is not None:
        desc += (" Decode-context-parallel rank %d of %d: the rank holds global tokens t with "
                 "t mod %d == %d, packed in its own blocks (local token t div %d); a %d-token "
                 "chunk holds %d of this rank's tokens." %
                 (dcp[1], dcp[0], dcp[0], dcp[1], dcp[0], CHUNK_TOKENS, CHUNK_TOKENS // dcp[0]))
    return preset(name, desc, [region("kv", count=DSV3_LAYERS)],
                  [group("full", "full", MLA_BLOCK,
                         [attention_layer(shape, DSV3_LAYERS, "kv", region_step=1)])],
                  dcp=dcp)


def deepseek_mla_fp8_656():
    latent, scales, rope = 512 * FP8, 16, 64 * BF16
    row = latent + scales + rope  # 656
    shape = Shape({"NB": NUM_BLOCKS, "T": MLA_BLOCK, "R": row}, ["NB", "T", "R"], FP8)
    desc = ("DeepSeek V3: 61 layers, FlashMLA sparse fp8 MLA cache: per token one %d-byte row "
            "= %d fp8 latent bytes + %d scale bytes + %d bf16 rope bytes (planes 1, heads 1, "
            "elem_bytes 1), block_size %d. One tensor per layer (one region each), logical "
            "shape (num_blocks, block_size, %d) uint8, physical order %s." %
            (row, latent, scales, rope, MLA_BLOCK, row, shape.text()))
    return preset("deepseek-v3-mla-fp8-656", desc, [region("kv", count=DSV3_LAYERS)],
                  [group("full", "full", MLA_BLOCK,
                         [attention_layer(shape, DSV3_LAYERS, "kv", region_step=1)])])


# ---- gpt-oss-20b-like: alternating full and sliding-window layers -------------

def gpt_oss_20b_like():
    layers, H, D, BS, window = 24, 8, 64, 16, 128
    per_group = layers // 2
    shape = Shape({"P": 2, "NB": NUM_BLOCKS, "T": BS, "H": H, "R": D},
                  ["P", "NB", "T", "H", "R"], BF16)
    desc = ("gpt-oss-20b-like: 24 layers alternating sliding_window(%d) (even model layers) and "
            "full attention (odd model layers), 8 KV heads, head_dim 64, bf16, block_size 16. "
            "vLLM makes two KV-cache groups of %d layers (full, sliding_window) over one block "
            "pool; layer i of both groups shares one tensor (region kv[i]; the sliding-window "
            "views are declared aliases of the full views, block ids are disjoint). "
            "FlashAttention NHD: logical shape (2, num_blocks, block_size, num_kv_heads, "
            "head_size), physical order %s. plane_stride is \"num_blocks * block_stride\": it "
            "follows num_blocks (and any num_blocks_override). The sliding-window group gets "
            "its own object group." %
            (window, per_group, shape.text()))
    full = attention_layer(shape, per_group, "kv", region_step=1)
    swa = attention_layer(shape, per_group, "kv", region_step=1,
                          alias={"group": "full", "layer": 0, "layer_step": 1})
    return preset("gpt-oss-20b-like", desc, [region("kv", count=per_group)],
                  [group("full", "full", BS, [full]),
                   group("sliding", "sliding_window", BS, [swa], window=window)])


# ---- Qwen3-Next-80B-A3B, one tensor-parallel-4 rank ----------------------------

def qwen3_next_like_hybrid():
    layers, interval, tp = 48, 4, 4
    full_layers = layers // interval          # 12 full-attention layers
    linear_layers = layers - full_layers      # 36 Gated-DeltaNet layers
    per_group = full_layers
    linear_groups = linear_layers // per_group  # 3 recurrent groups of 12
    kv_heads = max(1, 2 // tp)                # 2 KV heads replicated over 4 ranks
    head_dim = 256
    # Gated DeltaNet state per layer per slot, this rank's share.
    conv_dim, conv_kernel = 8192 // tp, 4
    v_heads, k_dim, v_dim = 32 // tp, 128, 128
    conv_bytes = conv_dim * (conv_kernel - 1) * BF16         # 12288
    ssm_bytes = v_heads * k_dim * v_dim * BF16               # 262144
    mamba_page = conv_bytes + ssm_bytes                      # 274432
    attn_bytes_per_token = 2 * kv_heads * head_dim * BF16     # K and V: 1024
    # vLLM raises the attention block size (to a multiple of 16 tokens) until
    # the attention page holds the mamba page, then pads mamba pages to it.
    block = round_up(-(-mamba_page // attn_bytes_per_token), 16)
    page = block * attn_bytes_per_token
    assert (block, page) == (272, 278528), (block, page)
    # chunk_tokens must be a multiple of the block size: two blocks per chunk.
    chunk = 2 * block
    # Hybrid models re-stride attention so K and V of one block are adjacent.
    shape = Shape({"NB": NUM_BLOCKS, "P": 2, "T": block, "H": kv_heads, "R": head_dim},
                  ["NB", "P", "T", "H", "R"], BF16)
    assert shape.stride("NB") == page
    desc = ("qwen3-next-like-hybrid: Qwen3-Next-80B-A3B, one tensor-parallel-4 rank. 48 layers: "
            "3 Gated-DeltaNet linear-attention layers per full-attention layer. vLLM groups: "
            "1 full group of %d layers + %d recurrent groups of %d layers; layer i of every "
            "group shares one tensor (region kv[i]; recurrent views are declared aliases of "
            "the full views, block ids disjoint). Full attention per rank: %d KV head (the "
            "model's 2 KV heads over 4 ranks, each replicated on 2), head_dim %d, bf16. Linear state per layer per slot: "
            "conv state (conv_dim %d, kernel-1 = %d) bf16 = %d B, then ssm state (%d v-heads, "
            "%d, %d) bf16 = %d B: %d B. Page sizes unified: attention block_size raised to %d "
            "(a multiple of 16) so the attention page 2*%d*%d*%d*2 = %d B holds the mamba "
            "state, mamba slots padded to the same %d-byte page. Attention re-strided so K "
            "and V of one block are adjacent: physical order %s. chunk_tokens %d (two "
            "%d-token blocks). separate_recurrent false: each chunk object of the single object group "
            "carries the chunk's attention KV and the linear state at the chunk's end, so a "
            "prefix hit restores both or neither (glm-like-hybrid covers separate recurrent "
            "object groups)." %
            (per_group, linear_groups, per_group, kv_heads, head_dim, conv_dim,
             conv_kernel - 1, conv_bytes, v_heads, k_dim, v_dim, ssm_bytes, mamba_page, block,
             block, kv_heads, head_dim, page, page, shape.text(), chunk, block))
    groups = [group("full", "full", block, [attention_layer(shape, per_group, "kv",
                                                            region_step=1)])]
    for j in range(linear_groups):
        groups.append(group("linear%d" % j, "recurrent", None,
                            [recurrent_layer(per_group, "kv", 1, page, [conv_bytes, ssm_bytes],
                                             BF16,
                                             alias={"group": "full", "layer": 0,
                                                    "layer_step": 1})]))
    return preset("qwen3-next-like-hybrid", desc, [region("kv", count=per_group)], groups,
                  chunk_tokens=chunk, separate_recurrent=False)


# ---- glm-like-hybrid: our own hybrid with padded pages -------------------------

def glm_like_hybrid():
    per_group, H, D, BS, window = 8, 4, 128, 16, 512
    conv_dim, conv_kernel = 1024, 4
    ssm_heads, ssm_k, ssm_v = 4, 64, 64
    conv_bytes = conv_dim * (conv_kernel - 1) * BF16      # 6144
    ssm_bytes = ssm_heads * ssm_k * ssm_v * BF16          # 32768
    state_bytes = conv_bytes + ssm_bytes                  # 38912
    attn_page = 2 * BS * H * D * BF16                     # 32768
    # Neither page divides the other: both are padded to one 4 KiB-rounded page.
    page = round_up(max(state_bytes, attn_page), 4096)    # 40960
    assert page > attn_page and page > state_bytes
    shape = Shape({"NB": NUM_BLOCKS, "P": 2, "T": BS, "H": H, "R": D},
                  ["NB", "P", "T", "H", "R"], BF16)
    # Block-outermost: the padded page is the block stride.
    attn = attention_layer(shape, per_group, "kv", region_step=1, block_stride=page)
    swa = attention_layer(shape, per_group, "kv", region_step=1, block_stride=page,
                          alias={"group": "full", "layer": 0, "layer_step": 1})
    rec = recurrent_layer(per_group, "kv", 1, page, [conv_bytes, ssm_bytes], BF16,
                          alias={"group": "full", "layer": 0, "layer_step": 1})
    desc = ("glm-like-hybrid: our own GLM-style hybrid configuration, 24 layers in three "
            "KV-cache groups of %d: full attention, sliding_window(%d) and recurrent; layer i "
            "of each group shares one tensor (region kv[i]; sliding and recurrent views are "
            "declared aliases of the full views, block ids disjoint). Attention: %d KV heads, "
            "head_dim %d, bf16, block_size %d, K and V of one block adjacent (payload %s = %d "
            "B). Recurrent state per slot: conv state (conv_dim %d, kernel-1 = %d) bf16 = %d B, "
            "then ssm state (%d heads, %d, %d) bf16 = %d B: %d B. Neither page divides the "
            "other, so both are padded to a %d-byte page: every block_stride exceeds its "
            "payload (padding the copies must leave untouched). %d MiB of cache at 2048 "
            "blocks (a 32k-token prefix of the full group). separate_recurrent true: the state gets its own object group, next to "
            "the full and sliding-window object groups." %
            (per_group, window, H, D, BS, shape.text().replace("NB=%d, " % NUM_BLOCKS, ""),
             attn_page, conv_dim, conv_kernel - 1, conv_bytes, ssm_heads, ssm_k, ssm_v,
             ssm_bytes, state_bytes, page, per_group * page * 2048 >> 20))
    return preset("glm-like-hybrid", desc, [region("kv", count=per_group)],
                  [group("full", "full", BS, [attn]),
                   group("sliding", "sliding_window", BS, [swa], window=window),
                   group("recurrent", "recurrent", None, [rec])],
                  separate_recurrent=True)


# ---- Llama 3.1 70B, one tensor-parallel rank's head slice ----------------------

def llama70b_tp4_rank2_slice():
    layers, total_heads, D, BS = 80, 8, 128, 16
    first_head, heads = 4, 2
    shape = Shape({"NB": NUM_BLOCKS, "P": 2, "T": BS, "H": total_heads, "R": D},
                  ["NB", "P", "T", "H", "R"], BF16)
    head_bytes = D * BF16
    layer = attention_layer(shape, layers, "kv", region_step=1,
                            offset=first_head * shape.stride("H"), heads=heads)
    desc = ("Llama 3.1 70B: 80 layers, 8 KV heads, head_dim 128, bf16, block_size 16. "
            "FlashInfer NHD, one tensor per layer (one region each), logical shape "
            "(num_blocks, 2, block_size, num_kv_heads, head_size), physical order %s, holding "
            "all 8 heads; this geometry is tensor-parallel rank 2 of 4's slice: KV heads %d-%d "
            "(offset %d = %d head rows, heads %d, head_stride %d). The other heads of each "
            "token row belong to other ranks: copies must leave them untouched." %
            (shape.text(), first_head, first_head + heads - 1, first_head * head_bytes,
             first_head, heads, shape.stride("H")))
    return preset("llama-3.1-70b-tp4-rank2-slice", desc, [region("kv", count=layers)],
                  [group("full", "full", BS, [layer])])


# ---- the list ---------------------------------------------------------------

def all_presets():
    fa = "vLLM FlashAttention NHD"
    fah = "vLLM FlashAttention HND"
    fi = "vLLM FlashInfer NHD"
    fih = "vLLM FlashInfer HND"
    return [
        llama8b_per_layer("llama-3.1-8b-fa-nhd", fa, ["P", "NB", "T", "H", "R"],
                          "(2, num_blocks, block_size, num_kv_heads, head_size)"),
        llama8b_per_layer("llama-3.1-8b-fa-hnd", fah, ["P", "NB", "H", "T", "R"],
                          "(2, num_blocks, block_size, num_kv_heads, head_size)"),
        llama8b_per_layer("llama-3.1-8b-flashinfer-nhd", fi, ["NB", "P", "T", "H", "R"],
                          "(num_blocks, 2, block_size, num_kv_heads, head_size)"),
        llama8b_per_layer("llama-3.1-8b-flashinfer-hnd", fih, ["NB", "P", "H", "T", "R"],
                          "(num_blocks, 2, block_size, num_kv_heads, head_size)"),
        llama8b_crosslayer("llama-3.1-8b-crosslayer-fa-nhd", "vLLM FlashAttention NHD "
                           "cross-layer layout", ["NB", "L", "P", "T", "H", "R"],
                           "(num_blocks, num_layers, 2, block_size, num_kv_heads, head_size)"),
        llama8b_crosslayer("llama-3.1-8b-crosslayer-fa-hnd", "vLLM FlashAttention HND "
                           "cross-layer layout", ["NB", "H", "L", "P", "T", "R"],
                           "(num_blocks, num_layers, 2, block_size, num_kv_heads, head_size)"),
        deepseek_mla_bf16(),
        deepseek_mla_fp8_656(),
        llama8b_fp8_inline_scales(),
        gpt_oss_20b_like(),
        qwen3_next_like_hybrid(),
        glm_like_hybrid(),
        llama70b_tp4_rank2_slice(),
        deepseek_mla_bf16("deepseek-v3-mla-dcp4-rank1", dcp=(4, 1)),
    ]


# ---- self-check: expand the compact form and look for overlaps -----------------

def expand(doc):
    """Expand regions and layers as the loader does; returns (regions, views)
    where each view is a dict with the resolved region index."""
    regions = []
    for r in doc["regions"]:
        count = r.get("count", 1)
        for k in range(count):
            regions.append(r["name"] if count == 1 else "%s[%d]" % (r["name"], k))
    index = {name: i for i, name in enumerate(regions)}
    for r in doc["regions"]:
        if r.get("count", 1) > 1:
            index[r["name"]] = index[r["name"] + "[0]"]
    views = []
    for g, grp in enumerate(doc["groups"]):
        layer_index = 0
        for entry in grp["layers"]:
            for k in range(entry.get("count", 1)):
                v = dict(entry)
                v["group"] = g
                v["layer"] = layer_index
                v["region_index"] = index[entry["region"]] + k * entry.get("region_step", 0)
                v["offset"] = entry.get("offset", 0) + k * entry.get("offset_step", 0)
                alias = entry.get("alias_of")
                if alias is not None:
                    ag = [x["name"] for x in doc["groups"]].index(alias["group"])
                    v["alias"] = (ag, alias["layer"] + k * alias.get("layer_step", 1))
                views.append(v)
                layer_index += 1
    return regions, views


def plane_stride(view, num_blocks):
    """A view's plane stride in bytes: an integer, or the string form the
    loader computes from the group's num_blocks."""
    value = view.get("plane_stride", 0)
    if isinstance(value, str):
        assert value.replace(" ", "") == BLOCKS_EXPR.replace(" ", ""), value
        return num_blocks * view["block_stride"]
    return value


def runs(view, num_blocks):
    """Every (start, length) byte run of a view for blocks 0..num_blocks-1."""
    out = []
    block_stride = view["block_stride"]
    if "states" in view:
        for b in range(num_blocks):
            for s in view["states"]:
                out.append((view["offset"] + b * block_stride + s["offset"], s["bytes"]))
        return out
    hb = view["head_bytes"]
    hb = hb if isinstance(hb, list) else [hb] * view["planes"]
    ps = plane_stride(view, num_blocks)
    for b in range(num_blocks):
        for p in range(view["planes"]):
            for t in range(view["block_size"]):
                for h in range(view["heads"]):
                    out.append((view["offset"] + b * block_stride + p * ps
                                + t * view["token_stride"] + h * view.get("head_stride", 0),
                                hb[p]))
    return out


def check(doc):
    """Validate a preset the way finalize will, independently: no two runs of
    views that are not declared aliases overlap; returns region sizes."""
    regions, views = expand(doc)
    by_key = {(v["group"], v["layer"]): v for v in views}

    def root(v):
        while "alias" in v:
            v = by_key[v["alias"]]
        return (v["group"], v["layer"])

    sizes = [0] * len(regions)
    per_region = {}
    for v in views:
        grp = doc["groups"][v["group"]]
        v["block_size"] = grp.get("block_size", 1)
        for start, length in runs(v, grp["num_blocks"]):
            assert start % v["elem_bytes"] == 0
            sizes[v["region_index"]] = max(sizes[v["region_index"]], start + length)
            per_region.setdefault(v["region_index"], []).append(
                (start, start + length, root(v), (v["group"], v["layer"])))
    for r, spans in per_region.items():
        spans.sort()
        # Runs of one alias class may overlap only across different views.
        reach = []  # (end, root, view) of runs still open
        for start, end, rt, key in spans:
            reach = [x for x in reach if x[0] > start]
            for other_end, other_root, other_key in reach:
                if other_root != rt or other_key == key:
                    raise SystemExit("%s: region %s: runs of %s and %s overlap at %d" %
                                     (doc["name"], regions[r], other_key, key, start))
            reach.append((end, rt, key))
    return regions, sizes


# ---- main -------------------------------------------------------------------

def render(value, indent=0):
    """Pretty JSON, two-space indents; a container holding only scalars stays
    on one line when it is short (states, alias_of)."""
    if not isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=True)
    items = list(value.items()) if isinstance(value, dict) else list(enumerate(value))
    open_, close = ("{", "}") if isinstance(value, dict) else ("[", "]")
    if not items:
        return open_ + close

    def key(k):
        return json.dumps(k) + ": " if isinstance(value, dict) else ""

    flat = all(not isinstance(v, (dict, list)) for _, v in items)
    if flat and indent > 0:
        line = open_ + ", ".join(key(k) + render(v) for k, v in items) + close
        if indent + len(line) <= 80:
            return line
    pad = " " * (indent + 2)
    body = ",\n".join(pad + key(k) + render(v, indent + 2) for k, v in items)
    return open_ + "\n" + body + "\n" + " " * indent + close


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    default_out = os.path.join(os.path.dirname(here), "geometry", "presets")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=default_out, help="output directory")
    ap.add_argument("--check", action="store_true",
                    help="compare with the files in --out instead of writing")
    ap.add_argument("--summary", action="store_true", help="print sizes")
    args = ap.parse_args()

    docs = all_presets()
    names = [d["name"] for d in docs]
    assert len(set(names)) == len(names)
    stale = []
    for doc in docs:
        regions, sizes = check(doc)
        text = render(doc) + "\n"
        assert json.loads(text) == doc
        path = os.path.join(args.out, doc["name"] + ".json")
        if args.summary:
            print("%-34s %3d regions  %9.1f MiB at num_blocks %d" %
                  (doc["name"], len(regions), sum(sizes) / 2**20, NUM_BLOCKS))
        if args.check:
            try:
                with open(path, encoding="utf-8") as f:
                    if f.read() != text:
                        stale.append(path)
            except FileNotFoundError:
                stale.append(path)
        else:
            os.makedirs(args.out, exist_ok=True)
            with open(path, "w", encoding="utf-8", newline="\n") as f:
                f.write(text)
    if args.check:
        extra = sorted(f for f in os.listdir(args.out)
                       if f.endswith(".json") and f[:-5] not in names)
        for path in stale:
            print("stale or missing: %s (run tools/gen_presets.py)" % path, file=sys.stderr)
        for f in extra:
            print("not generated by tools/gen_presets.py: %s" % f, file=sys.stderr)
        return 1 if stale or extra else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
