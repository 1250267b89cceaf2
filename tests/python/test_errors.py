"""The one exception type, its status and the field it names (kvferry._errors)."""

import pickle
import threading

import pytest

import kvferry
from kvferry import KvferryError, Status
from kvferry._errors import parse_field


def test_status_words_are_the_librarys():
    for s in Status:
        assert s.text == kvferry.status_string(s), s
    assert kvferry.status_string(999) == "unknown status"


@pytest.mark.parametrize("message, field", [
    ("token_begin 5: must be a multiple of chunk_tokens 16", "token_begin"),
    ("groups[1].block_ids[7] 40: not below num_blocks 32", "groups[1].block_ids[7]"),
    ("region_bases[0] 0x55c39ad6d4a0: not aligned to the region's align 256", "region_bases[0]"),
    ("region_bases[2]: NULL, but group 0 layer 1 lives there", "region_bases[2]"),
    ("objects[3]: NULL, but chunk 1 of object group 0 moves blocks", "objects[3]"),
    ("kvf_xfer_create: device 7: no such CUDA device (1 visible)", "device"),
    ("kvf_mem_alloc_create: options.size is 0", "options.size"),
    ("presets/x.json: groups[1].layers[0].token_stride: expected a non-negative integer",
     "groups[1].layers[0].token_stride"),
    ("group 'full' (0), layer 3 ('layer[3]'): token_stride 8: smaller than the 16 bytes",
     "token_stride"),
    ("fingerprint 0c3fa61e2b7d9e10: the object was made by a different geometry", "fingerprint"),
    ("line 4, column 3: unexpected token", None),
    ("copy request: geometry or request is NULL", None),
    ("geometry file '/x.json': No such file or directory", None),
    ("", None),
])
def test_parse_field(message, field):
    assert parse_field(message) == field


def test_a_failing_c_call_raises_with_status_field_and_message():
    g = kvferry.Geometry.preset("deepseek-v3-mla-bf16")
    with pytest.raises(KvferryError) as e:
        g.region(5000)
    err = e.value
    assert err.status == Status.INVALID_ARGUMENT
    assert err.message == "kvf_geometry_region: index 5000 out of range (61 regions)"
    assert str(err) == "invalid argument: " + err.message
    assert isinstance(err, Exception)
    g.close()


def test_errors_pickle():
    err = KvferryError(Status.PARSE, "version: unsupported", field="version", group=1, layer=2)
    back = pickle.loads(pickle.dumps(err))
    assert (back.status, back.message, back.field, back.group, back.layer) == (
        Status.PARSE, "version: unsupported", "version", 1, 2)
    assert "KvferryError" in repr(back)


def test_an_unknown_status_stays_an_int():
    err = KvferryError(77, "from a newer library")
    assert err.status == 77 and not isinstance(err.status, Status)
    assert str(err) == "status 77: from a newer library"


def test_messages_are_per_thread():
    # kvf_last_error() is thread-local: a failure on one thread never shows
    # up in another's exception.
    g = kvferry.Geometry.preset("deepseek-v3-mla-bf16")
    seen = {}

    def fail(i):
        for _ in range(200):
            try:
                g.region(1000 + i)
            except KvferryError as exc:
                if "index %d " % (1000 + i) not in exc.message:
                    seen[i] = exc.message
    threads = [threading.Thread(target=fail, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not seen
    g.close()
