"""The transfers of kvferry.vllm's offloading without vLLM (kvferry.vllm._mover):
vLLM-shaped KV caches (vLLM 0.33's [blocks, heads, tokens, K|V] views into one
backing allocation, groups overlaid, Mamba pages padded) stored into the
pinned CPU pool and loaded back into other blocks, byte for byte, on the host
backend and, where there is one, on a GPU: streams, events, lanes.

Needs torch (skipped without it); vLLM's own classes are tested in tests/vllm.
"""

import pytest

torch = pytest.importorskip("torch")

import kvferry  # noqa: E402
from kvferry.geometry import GroupKind  # noqa: E402
from kvferry.vllm._layout import GroupInput, build_layout  # noqa: E402
from kvferry.vllm._mover import Mover  # noqa: E402

NB, H, N, D = 64, 2, 16, 64          # blocks, KV heads, tokens per block, head size (bf16)
PAGE = H * N * 2 * D * 2             # an attention page: 8192 bytes
STATES = (576, 4096)                 # a Mamba layer's conv and SSM state bytes (padded to PAGE)


def devices():
    out = ["cpu"]
    if torch.cuda.is_available() and kvferry.cuda_probe().available:
        out.append("cuda")
    return out


def make_cache(device):
    """What vLLM allocates for 2 full-attention layers, 2 sliding-window layers
    overlaid on them, and 2 Mamba layers overlaid too (LBHNC)."""
    raw = torch.zeros(2 * NB * PAGE, dtype=torch.uint8, device=device)
    attn = [raw[l * NB * PAGE:(l + 1) * NB * PAGE].view(NB, H, N, 2 * D * 2) for l in range(2)]
    pages = [raw[l * NB * PAGE:(l + 1) * NB * PAGE].view(NB, PAGE) for l in range(2)]
    mamba = [[p[:, :STATES[0]], p[:, STATES[0]:STATES[0] + STATES[1]]] for p in pages]
    return raw, attn, mamba


def layout_of(attn, mamba, blocks_per_chunk):
    planes = [a.unflatten(-1, (2, D * 2)) for a in attn]
    groups = [
        GroupInput(0, GroupKind.FULL, {"full%d" % i: v for i, v in enumerate(planes)},
                   "blocks,heads,tokens,planes,head_size", ratio=1, tokens=N),
        GroupInput(1, GroupKind.SLIDING_WINDOW, {"swa%d" % i: v for i, v in enumerate(planes)},
                   "blocks,heads,tokens,planes,head_size", window=48, ratio=1, tokens=N),
        GroupInput(2, GroupKind.RECURRENT, {"mamba%d" % i: s for i, s in enumerate(mamba)}),
    ]
    return build_layout(groups, blocks_per_chunk)


def drain(mover, count):
    done = []
    for _ in range(10000):
        done += mover.finished()
        if len(done) >= count:
            return done
        if mover.device is not None:
            torch.cuda.synchronize()
    raise AssertionError("jobs did not finish: %d of %d" % (len(done), count))


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
@pytest.mark.parametrize("device", devices())
def test_store_then_load_into_other_blocks(device, blocks_per_chunk):
    raw, attn, mamba = make_cache(device)
    gen = torch.Generator().manual_seed(blocks_per_chunk)
    raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))
    layout = layout_of(attn, mamba, blocks_per_chunk)
    assert len(layout.units) == 1 and layout.units[0].geometry.num_object_groups == 3
    assert layout.groups[2].object_bytes == 2 * sum(STATES)        # padding stays behind
    mover = Mover(layout, num_chunks=32, device=0 if device == "cuda" else None)
    try:
        if device == "cuda":
            assert mover.pool.is_pinned()
        # Full: logical blocks 0..5 in GPU blocks 10..15; sliding window: blocks
        # 3..5 in 20..22; Mamba: the state of block 5 in slot 30.
        bpc = blocks_per_chunk
        full_chunks = list(range(0, -(-6 // bpc)))
        swa_chunks = [10 + c for c in range(-(-(3 + 3 % bpc) // bpc))]
        mamba_chunks = [20]
        gpu = list(range(10, 16)) + [20, 21, 22] + [30]
        mover.submit("store", 1, True, gpu, [6, 3, 1], [0, 3, 5],
                     full_chunks + swa_chunks + mamba_chunks)
        (job,) = drain(mover, 1)
        assert job.job_id == 1 and job.success, job.reason
        assert job.num_bytes == 6 * 2 * PAGE + 3 * 2 * PAGE + 2 * sum(STATES)
        before = raw.clone()
        raw.fill_(0xEE)
        # Load them into other blocks, the full group on the expedited lane's
        # neighbour: two jobs, two lanes.
        mover.submit("load", 2, False, list(range(40, 46)), [6, 0, 0], [0, 0, 0], full_chunks)
        mover.submit("expedited", 3, False, [50, 51, 52, 60], [0, 3, 1], [0, 3, 5],
                     swa_chunks + mamba_chunks)
        mover.wait({3})
        jobs = drain(mover, 2)
        assert sorted(j.job_id for j in jobs) == [2, 3] and all(j.success for j in jobs)
        got, want = raw.cpu(), before.cpu()
        for layer in range(2):
            base = layer * NB * PAGE
            for src, dst in list(zip(range(10, 16), range(40, 46))) + \
                    list(zip([20, 21, 22], [50, 51, 52])):
                assert torch.equal(got[base + dst * PAGE:base + (dst + 1) * PAGE],
                                   want[base + src * PAGE:base + (src + 1) * PAGE]), (layer, src)
            n = sum(STATES)
            assert torch.equal(got[base + 60 * PAGE:base + 60 * PAGE + n],
                               want[base + 30 * PAGE:base + 30 * PAGE + n])
            # The Mamba page's padding was not written.
            assert bool((got[base + 60 * PAGE + n:base + 61 * PAGE] == 0xEE).all())
        written = set()
        for layer in range(2):
            for b in list(range(40, 46)) + [50, 51, 52, 60]:
                written.update(range(layer * NB * PAGE + b * PAGE, layer * NB * PAGE + (b + 1) * PAGE))
        mask = torch.ones(got.numel(), dtype=torch.bool)
        mask[torch.tensor(sorted(written))] = False
        assert bool((got[mask] == 0xEE).all()), "bytes outside the loaded blocks were written"
    finally:
        mover.close()


@pytest.mark.parametrize("device", devices())
def test_failed_store_poisons_its_chunks(device, monkeypatch):
    raw, attn, mamba = make_cache(device)
    mover = Mover(layout_of(attn, mamba, 1), num_chunks=8, device=0 if device == "cuda" else None)
    try:
        def refuse(xfer, request, stream=None):
            raise kvferry.KvferryError(kvferry.Status.CUDA, "injected")

        monkeypatch.setattr(kvferry.Transfer, "gather", refuse)
        mover.submit("store", 1, True, [1, 2], [2, 0, 0], [0, 0, 0], [3, 4])
        (job,) = drain(mover, 1)
        assert not job.success and "injected" in job.reason
        mover.submit("load", 2, False, [5], [1, 0, 0], [1, 0, 0], [4])
        (job,) = drain(mover, 1)
        assert not job.success and "not stored whole" in job.reason
        # A job that does not add up fails too, without a copy.
        mover.submit("load", 3, False, [5, 6], [1, 0, 0], [0, 0, 0], [4])
        (job,) = drain(mover, 1)
        assert not job.success and "cannot plan" in job.reason
    finally:
        mover.close()
