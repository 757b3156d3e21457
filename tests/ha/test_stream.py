"""The replication frame codec (`amqbroker.ha.stream`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from amqbroker.ha import stream as st
from amqbroker.store.journal_segments import Batch
from amqbroker.store.paging import PageBatch

SID = bytes(range(16))


def test_chunk_round_trip() -> None:
    h, f = st.decode(st.encode_chunk(7, SID, "journal/segment-00000001.log", 4096, b"abc"))
    assert (h.kind, h.epoch, h.stream) == (st.SNAPSHOT_FILE_CHUNK, 7, SID)
    assert f == st.FileChunk("journal/segment-00000001.log", 4096, b"abc")


def test_done_round_trip() -> None:
    h, f = st.decode(st.encode_done(3, SID, 12))
    assert h.kind == st.SNAPSHOT_DONE and f == st.SnapshotDone(12)


def test_batch_round_trip() -> None:
    b = Batch([(1, b"one"), (1, bytearray(b"two")), (2, b"")], records=5, nbytes=6, closes=9)
    b.deletes = [0, 1]
    p = PageBatch([(4, 1, True, bytearray(b"page")), (5, 2, False, bytearray(b"x"))], True)
    p.deletes = [(4, 0), (5, 1)]
    h, f = st.decode(st.encode_batch(1, SID, 42, b, p))
    assert h.kind == st.BATCH
    assert isinstance(f, st.CycleBatch)
    assert f.cycle == 42 and f.records == 5
    assert f.journal is not None and f.pages is not None
    assert [(s, bytes(d)) for s, d in f.journal.writes] == [(1, b"one"), (1, b"two"), (2, b"")]
    assert f.journal.deletes == [0, 1]
    assert f.pages.writes == p.writes and f.pages.durable
    assert f.pages.deletes == [(4, 0), (5, 1)]
    assert f.nbytes == 6 + 5


def test_batch_records_reads_the_count_without_decoding() -> None:
    frame = st.encode_batch(0, SID, 1, Batch([(1, b"data")], 17, 4, 1), None)
    assert st.batch_records(b"prefix.." + frame, 8) == 17
    assert st.batch_records(st.encode_done(0, SID, 1)) == 0
    assert st.batch_records(frame[:10]) == 0


def test_empty_batch_halves_are_none() -> None:
    _, f = st.decode(st.encode_batch(0, SID, 1, None, None))
    assert isinstance(f, st.CycleBatch) and f.journal is None and f.pages is None


def test_other_version_truncation_and_kind_are_refused() -> None:
    frame = st.encode_batch(0, SID, 1, Batch([(1, b"data")], 1, 4, 1), None)
    with pytest.raises(st.StreamError, match="version 9"):
        st.decode(b"\x09" + frame[1:])
    with pytest.raises(st.StreamError, match="damaged"):
        st.decode(frame[:-3])
    with pytest.raises(st.StreamError, match="after the batch"):
        st.decode(frame + b"\0")
    with pytest.raises(st.StreamError, match="shorter than its header"):
        st.decode(frame[:5])
    with pytest.raises(st.StreamError, match="unknown"):
        st.decode(frame[:1] + b"\x63" + frame[2:])


def test_a_backup_refuses_a_primary_of_an_older_epoch(tmp_path: Path) -> None:
    from amqbroker.ha.mirror import MirrorStore, read_state

    m = MirrorStore(tmp_path, sync=False)
    new, old = bytes(16), bytes([1] * 16)
    m.apply(*st.decode(st.encode_chunk(5, new, "journal/segment-00000001.log", 0, b"x")))
    m.apply(*st.decode(st.encode_done(5, new, 1)))
    assert m.in_sync and read_state(tmp_path) == {"epoch": 5, "stream": new.hex(), "in_sync": True}
    assert (tmp_path / "journal" / "segment-00000001.log").read_bytes() == b"x"
    m.close()
    m = MirrorStore(tmp_path, sync=False)  # restarted: remembers the epoch it followed
    with pytest.raises(st.StreamError, match="epoch 4 is older than epoch 5"):
        m.apply(*st.decode(st.encode_chunk(4, old, "journal/segment-00000001.log", 0, b"y")))
    # the copy it holds and its marker are untouched by the refused stream
    assert read_state(tmp_path) == {"epoch": 5, "stream": new.hex(), "in_sync": True}
    assert (tmp_path / "journal" / "segment-00000001.log").read_bytes() == b"x"
    with pytest.raises(st.StreamError, match="not a store file"):
        m.apply(*st.decode(st.encode_chunk(6, old, "../evil", 0, b"y")))
    m.close()
