"""The CUDA IPC backend: bytes intact between two processes on one GPU, peers re-mapped after a restart,
clear errors where it cannot run; and the pure arithmetic it rests on (runs everywhere).

The GPU tests run only where CUDA is (an H200, say); CI has no GPU and skips them.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from splitserve.transfer import (
    AuxData,
    AuxReader,
    AuxWriter,
    CudaIpcUnavailableError,
    KVLayout,
    KVPoll,
    KVReceiver,
    KVSender,
    TransferConfig,
    layout_for_pool,
    make_aux_tensor,
    new_kv_manager,
    pack_aux,
    unpack_aux,
)
from splitserve.transfer.cuda_ipc.engine import CudaIpcEngine, check_runs, session_process, translate
from splitserve.transfer.cuda_ipc.segment_copy import PIECE_BYTES, SPARE_PROGRAMS, plan_copy, plan_runs
from splitserve.transfer.errors import CudaIpcError
from splitserve.transfer.kv.layout import IpcRegion
from splitserve.transfer.kv.plan import EMPTY, PageRuns, Segments

from .conftest import FAST, HEARTBEAT_MISSES, HEARTBEAT_S, SHAPE, fill_pool, poll_until_final, wait_until

IPC = FAST.replace(transfer_protocol="cuda_ipc")
IPC_PEER = {"transfer_protocol": "cuda_ipc", "transfer_heartbeat_interval_s": HEARTBEAT_S,
            "transfer_heartbeat_misses": HEARTBEAT_MISSES, "transfer_bootstrap_timeout_s": 10.0,
            "transfer_waiting_timeout_s": 10.0, "transfer_timeout_s": 10.0}
DIMS = (SHAPE["layers"], 2, SHAPE["pages"], SHAPE["page_size"], SHAPE["heads"], SHAPE["head_dim"])
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# ------------------------------------------------------------------ everywhere


def test_plan_has_one_row_per_segment_words_first_and_drops_empty_ones():
    anchor = 1 << 20
    srcs = np.array([anchor + 1000 + 4, anchor + 64, anchor + 5000])
    dsts = np.array([anchor + 8192, anchor + 4096, anchor])
    lens = np.array([12, 3 * PIECE_BYTES + 16, 0])  # an aux slot, a KV run over four pieces, nothing
    plan = plan_copy(srcs, dsts, lens, anchor)
    assert plan.words == 1 and plan.segments == 2
    assert plan.table[:, 0].tolist() == [8, 512, (3 * PIECE_BYTES + 16) // 8]  # in words
    assert plan.table[:, 1].tolist() == [1004, 8192, 12]  # in bytes
    assert plan.parts == 4  # one program per piece of the longest segment
    with pytest.raises(ValueError, match="aligned"):
        plan_copy(srcs, dsts, lens, anchor + 8)


def test_plan_loops_long_segments_rather_than_launch_idle_programs():
    # One long run beside many one-page segments: a program per piece of the long one for every row
    # would leave most of the grid idle, so the long one loops over fewer programs.
    anchor = 0
    lens = np.array([4096 * PIECE_BYTES] + [PIECE_BYTES] * 4000)
    offs = np.concatenate([[0], 4096 * PIECE_BYTES + PIECE_BYTES * np.arange(4000)])
    plan = plan_copy(offs, offs + (1 << 40), lens, anchor)
    pieces = 4096 + 4000
    assert 1 < plan.parts < 4096
    assert plan.segments * plan.parts <= 2 * pieces + plan.segments  # about two programs per piece
    small = plan_copy(offs[:2], offs[:2] + (1 << 40), lens[:2], anchor)
    assert small.parts == 4096  # two rows: one program per piece, 4,095 idle (within SPARE_PROGRAMS)
    assert small.segments * small.parts - (4096 + 1) <= SPARE_PROGRAMS


def _expand_run_table(plan, anchor: int) -> list[tuple[int, int, int]]:
    """What the page-runs kernel copies, read off its table as it does: (src, dst, bytes) per run per buffer,
    then per aux segment."""
    t, b, r, a = plan.table.tolist(), plan.buffers, plan.runs, plan.aux
    runs = t[2 * b:2 * b + 3 * r]
    aux = t[2 * b + 3 * r:]
    out = [(anchor + 8 * (t[k] + runs[i]), anchor + 8 * (t[b + k] + runs[r + i]), 8 * runs[2 * r + i])
           for k in range(b) for i in range(r)]
    return out + [(anchor + aux[i], anchor + aux[a + i], aux[2 * a + i]) for i in range(a)]


def test_page_runs_table_holds_runs_once_and_expands_to_every_run_of_every_buffer():
    anchor = 1 << 30
    src_bases = np.array([anchor + 4096, anchor + 8 * 4096, anchor - 3 * 4096])  # below the anchor too
    dst_bases = np.array([anchor + (1 << 20), anchor + (2 << 20), anchor + (3 << 20)])
    src_offs, dst_offs = np.array([0, 1024, 512]), np.array([2048, 0, 4096])
    lens = np.array([1024, 0, 3 * PIECE_BYTES + 8])  # the empty run is dropped
    aux = (np.array([anchor + 5]), np.array([anchor + 77]), np.array([12]))
    plan = plan_runs(src_bases, dst_bases, src_offs, dst_offs, lens, aux, anchor)
    assert (plan.buffers, plan.runs, plan.aux) == (3, 2, 1)
    assert len(plan.table) == 2 * 3 + 3 * 2 + 3 * 1  # O(runs + buffers), not O(runs x buffers)
    assert plan.parts == 4  # one program per piece of the longest run
    keep = lens > 0
    want = [(int(sb + so), int(db + do), int(n)) for sb, db in zip(src_bases, dst_bases, strict=True)
            for so, do, n in zip(src_offs[keep], dst_offs[keep], lens[keep], strict=True)]
    want.append((anchor + 5, anchor + 77, 12))
    assert _expand_run_table(plan, anchor) == want
    with pytest.raises(ValueError, match="multiple of 8"):
        plan_runs(src_bases + 4, dst_bases, src_offs, dst_offs, lens, aux, anchor)
    with pytest.raises(ValueError, match="multiple of 8"):
        plan_runs(src_bases, dst_bases, src_offs, dst_offs, lens + 2, aux, anchor)
    with pytest.raises(ValueError, match="aligned"):
        plan_runs(src_bases, dst_bases, src_offs, dst_offs, lens, aux, anchor + 8)
    only_aux = plan_runs(src_bases, dst_bases, src_offs[:0], dst_offs[:0], lens[:0], aux, anchor)
    assert (only_aux.runs, only_aux.aux) == (0, 1) and _expand_run_table(only_aux, anchor) == want[-1:]


def test_page_runs_past_a_buffer_are_refused():
    from splitserve.transfer.kv.layout import AuxBuffer, KVBuffer

    lay = KVLayout(tp_size=1, tp_rank=0, head_start=0, head_count=1, num_kv_heads=1, head_dim=16, page_size=4,
                   dtype="float16", num_layers=1, buffers=(KVBuffer(1 << 20, 128, 10), KVBuffer(2 << 20, 128, 10)),
                   aux=AuxBuffer(3 << 20, 12, 4))
    runs = PageRuns(lay, lay, np.array([0, 1152]), np.array([128, 0]), np.array([128, 128]), EMPTY)
    check_runs(runs, 1280, 1280)  # the last page of each side: inside
    with pytest.raises(CudaIpcError, match="source page run ends past"):
        check_runs(runs, 1279, 1280)
    with pytest.raises(CudaIpcError, match="destination page run ends past"):
        check_runs(PageRuns(lay, lay, runs.dst_offs, runs.src_offs, runs.lens, EMPTY), 1280, 1279)
    with pytest.raises(CudaIpcError, match="before its buffer"):
        check_runs(PageRuns(lay, lay, np.array([-128]), np.array([0]), np.array([128]), EMPTY), 1280, 1280)
    assert isinstance(runs.segments(), Segments) and len(runs.segments()) == 4  # 2 runs x 2 buffers


def test_translation_refuses_segments_outside_the_exported_regions():
    bases, sizes, local = np.array([1000, 100]), np.array([50, 20]), np.array([9000, 7000])
    got = translate(np.array([110, 1000, 1040]), np.array([10, 1, 10]), bases, sizes, local, "destination")
    assert got.tolist() == [7010, 9000, 9040]
    # All in one region: one shift for every segment; a segment running past that region's end is refused.
    assert translate(np.array([1000, 1010, 1049]), np.array([10, 0, 1]), bases, sizes, local,
                     "destination").tolist() == [9000, 9010, 9049]
    for addr, length in ((1045, 10), (99, 2), (130, 1)):
        with pytest.raises(CudaIpcError, match="outside"):
            translate(np.array([addr]), np.array([length]), bases, sizes, local, "destination")
        with pytest.raises(CudaIpcError, match="outside"):  # beside segments that are inside
            translate(np.array([1000, addr]), np.array([5, length]), bases, sizes, local, "destination")


def test_session_names_say_which_process_and_refuse_other_protocols():
    assert session_process("cuda_ipc:node-1:4242:ab12") == ("node-1", 4242)
    with pytest.raises(CudaIpcError, match="another transfer protocol"):
        session_process("127.0.0.1:15123")


def test_layout_carries_ipc_regions_and_mooncake_layouts_stay_as_they_were():
    pool = torch.zeros(DIMS, dtype=torch.float16)
    layout = layout_for_pool(pool, make_aux_tensor(4))
    assert "ipc_regions" not in layout.to_dict()
    with_regions = KVLayout.from_dict({**layout.to_dict(), "ipc_regions": [[4096, 1 << 20, "ab" * 64]]})
    assert with_regions.ipc_regions == (IpcRegion(4096, 1 << 20, "ab" * 64),)
    assert KVLayout.from_dict(with_regions.to_dict()) == with_regions
    with pytest.raises(ValueError):
        KVLayout.from_dict({**layout.to_dict(), "ipc_regions": [[4096, 1 << 20, "not hex"]]})


def test_config_takes_cuda_ipc():
    assert TransferConfig(transfer_protocol="cuda_ipc").transfer_protocol == "cuda_ipc"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_ipc_without_cuda_is_a_clear_error():
    pool = torch.zeros(DIMS, dtype=torch.float16)
    with pytest.raises(CudaIpcUnavailableError, match=r"needs a CUDA device.*--transfer-protocol tcp"):
        new_kv_manager(IPC, layout_for_pool(pool, make_aux_tensor(4)))


# ------------------------------------------------------------------ on a GPU


@needs_cuda
def test_cuda_ipc_with_the_pool_in_host_memory_is_a_clear_error():
    pool = torch.zeros(DIMS, dtype=torch.float16)
    with pytest.raises(CudaIpcUnavailableError, match="CUDA device memory"):
        new_kv_manager(IPC, layout_for_pool(pool, make_aux_tensor(4)))


@needs_cuda
def test_copy_kernel_moves_every_segment_exactly_and_nothing_else():
    from splitserve.transfer.cuda_ipc.segment_copy import CopyShape, SegmentCopier

    rng = np.random.default_rng(3)
    src = torch.randint(-2**62, 2**62, (1 << 22,), dtype=torch.int64, device="cuda").view(torch.uint8)  # 32 MiB
    dst = torch.zeros(1 << 26, dtype=torch.uint8, device="cuda")
    for shape in (CopyShape(), CopyShape(block=256, iters=1, warps=4)):  # 64 KiB and 2 KiB pieces
        dst.zero_()
        copier = SegmentCopier(torch.device("cuda"), shape)
        srcs, dsts, lens, at = [], [], [], 0
        for i in range(300):
            aligned = i % 7 != 0
            length = int(rng.integers(1, 20_000)) * (8 if aligned else 1) if i % 50 else 3 * shape.piece_bytes + 8
            offset = int(rng.integers(0, (len(src) - length) // 8)) * 8 + (0 if aligned else int(rng.integers(0, 8)))
            at += 0 if aligned else int(rng.integers(1, 8))
            srcs.append(offset)
            dsts.append(at)
            lens.append(length)
            at = (at + length + 64) // 8 * 8
        assert at < len(dst)
        copier.copy(np.array(srcs) + src.data_ptr(), np.array(dsts) + dst.data_ptr(), np.array(lens))
        want = torch.zeros_like(dst)
        for s, d, n in zip(srcs, dsts, lens, strict=True):
            want[d:d + n] = src[s:s + n]
        assert torch.equal(dst, want)


@needs_cuda
def test_aux_writes_on_the_gpu_are_queued_behind_the_stream_not_waited_for():
    aux = make_aux_tensor(8, slot_bytes=16, device="cuda")
    writer = AuxWriter(aux)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of queued work, as a forward pass in flight would be
    writer.write(5, AuxData(151643, -0.25, 17))
    writer.write(2, AuxData(1, 1.5, 0))
    behind = torch.cuda.Event()
    behind.record()
    assert not behind.query()  # the writes returned with the sleep still running: nothing waited for it
    writer.write(5, AuxData(9, 2.0, 4))  # the slot's next request: its copy lands after the first one
    torch.cuda.synchronize()
    assert unpack_aux(aux, 5) == AuxData(9, 2.0, 4) and unpack_aux(aux, 2) == AuxData(1, 1.5, 0)
    assert aux[[0, 1, 3, 4, 6, 7]].sum() == 0 and aux[[2, 5], 12:].sum() == 0
    with pytest.raises(IndexError):
        writer.write(8, AuxData(1, 0.0, 0))


@needs_cuda
def test_copies_on_a_stream_of_their_own_land_while_the_engine_s_stream_is_busy_and_read_its_aux_writes():
    """An engine's transfers (``own_stream``): a copy does not wait for the step queued on the engine's stream,
    and the aux slot written on the copy stream just before it is what it reads."""
    from splitserve.transfer.cuda_ipc.segment_copy import SegmentCopier

    stream = torch.cuda.Stream()
    copier = SegmentCopier(torch.device("cuda"), stream=stream)
    aux, landed = (make_aux_tensor(4, slot_bytes=16, device="cuda") for _ in range(2))
    writer = AuxWriter(aux, stream=stream)
    src = torch.randint(-2**62, 2**62, (1 << 16,), dtype=torch.int64, device="cuda")
    dst = torch.zeros_like(src)
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s queued on the engine's stream, as its next step would be
    busy = torch.cuda.Event()
    busy.record()
    writer.write(1, AuxData(151643, -0.25, 17))
    copier.copy(np.array([src.data_ptr(), aux[1].data_ptr()]), np.array([dst.data_ptr(), landed[2].data_ptr()]),
                np.array([src.numel() * 8, 16]))
    assert not busy.query()  # the copy returned once landed, with the step still running
    torch.cuda.synchronize()
    assert torch.equal(dst, src) and unpack_aux(landed, 2) == AuxData(151643, -0.25, 17)
    for own_stream in (True, False):
        engine = CudaIpcEngine("127.0.0.1", own_stream=own_stream)
        assert (engine.copy_stream is not None) == own_stream and engine.copier.stream is engine.copy_stream
        engine.close()


@needs_cuda
def test_aux_reads_on_the_gpu_do_not_wait_for_the_stream():
    aux = make_aux_tensor(8, slot_bytes=16, device="cuda")
    pack_aux(aux, 3, AuxData(151643, -0.25, 17))  # as the prefill's copy left it: landed before its Success
    pack_aux(aux, 6, AuxData(7, 1.5, 0))
    reader = AuxReader(aux)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of queued work, as the decode's forward pass in flight would be
    behind = torch.cuda.Event()
    behind.record()
    assert reader.read(3) == AuxData(151643, -0.25, 17) and reader.read(6) == AuxData(7, 1.5, 0)
    assert not behind.query()  # read with the sleep still running: nothing waited for it
    assert reader.read(0) == AuxData(0, 0.0, 0)
    with pytest.raises(IndexError):
        reader.read(8)
    torch.cuda.synchronize()
    host = AuxReader(make_aux_tensor(2))  # host memory: unpack_aux
    assert host.read(1) == AuxData(0, 0.0, 0)


@needs_cuda
def test_page_runs_kernel_copies_every_run_of_every_buffer_and_the_aux_exactly():
    from splitserve.transfer.cuda_ipc.segment_copy import CopyShape, SegmentCopier

    rng = np.random.default_rng(4)
    buffers, page, pages = 6, 4096, 64
    src = torch.randint(-2**62, 2**62, (buffers * pages * page // 8 + 8,), dtype=torch.int64, device="cuda")
    src_bytes = src.view(torch.uint8)
    dst = torch.zeros(buffers * pages * page + 4096, dtype=torch.uint8, device="cuda")
    src_offs = 64 + np.arange(buffers) * pages * page  # byte offsets of each buffer in the tensors
    dst_offs = 4096 + rng.permutation(buffers) * pages * page
    # 64 KiB pieces with the polled wait, 512-byte pieces (runs over many programs) with the blocking one
    for shape, wait in ((CopyShape(), "poll"), (CopyShape(block=64, iters=1, warps=4), "block")):
        dst.zero_()
        copier = SegmentCopier(torch.device("cuda"), shape, wait=wait)
        # Distinct pages on each side (a page written twice would make the order of the writes matter), with a
        # run of 10 pages consecutive on both sides among them.
        sp = np.concatenate([(rest := rng.permutation(np.setdiff1d(np.arange(pages), np.arange(20, 30))))[:10],
                             np.arange(20, 30), rest[10:30]])
        dp = np.concatenate([(rest := rng.permutation(np.setdiff1d(np.arange(pages), np.arange(40, 50))))[:10],
                             np.arange(40, 50), rest[10:30]])
        assert len(set(sp.tolist())) == len(set(dp.tolist())) == 40
        cut = np.ones(40, dtype=bool)
        cut[1:] = (np.diff(sp) != 1) | (np.diff(dp) != 1)
        starts = np.flatnonzero(cut)
        lens = np.diff(np.append(starts, 40)) * page
        aux_src, aux_dst = np.array([3, 21, 40]), np.array([1, 100, 2000])  # bytes, unaligned
        copier.copy_runs(src_bytes.data_ptr() + src_offs, dst.data_ptr() + dst_offs, sp[starts] * page,
                         dp[starts] * page, lens, (src_bytes.data_ptr() + aux_src, dst.data_ptr() + aux_dst,
                                                   np.full(3, 12)))
        want = torch.zeros_like(dst)
        for b in range(buffers):
            for so, do, n in zip(sp[starts] * page, dp[starts] * page, lens, strict=True):
                at = int(dst_offs[b] + do)
                want[at:at + n] = src_bytes[int(src_offs[b] + so):int(src_offs[b] + so) + n]
        for s_, d_ in zip(aux_src, aux_dst, strict=True):
            want[d_:d_ + 12] = src_bytes[s_:s_ + 12]
        assert torch.equal(dst, want)
        assert copier.last_wait_s > 0 and copier.last_host_s > 0


@needs_cuda
def test_rooms_from_a_prefill_process_land_intact_in_this_process_gpu_pool(spawn_peer, make_rank):
    prefill = spawn_peer({"role": "prefill", "seed": 7, "device": "cuda", "transfer": IPC_PEER})
    decode = make_rank(config=IPC, device="cuda")
    src_pool = fill_pool(DIMS, 7)
    rng = random.Random(5)
    src_free, dst_free = list(range(1, DIMS[2])), list(range(1, DIMS[2]))
    rng.shuffle(src_free)
    rng.shuffle(dst_free)
    plans = []
    for i in range(16):
        n = rng.randint(1, 6)
        chunks = [1] * n if i % 2 else [n]
        prefix = rng.randint(0, SHAPE["page_size"] * n - 1) if i % 4 == 3 else 0
        plans.append(dict(room=rng.getrandbits(63), src=[src_free.pop() for _ in range(n)],
                          dst=[dst_free.pop() for _ in range(n)], aux_index=i, chunks=chunks, prefix=prefix))
    prefill.command("send", rooms=[{"room": p["room"], "pages": p["src"], "aux_index": p["aux_index"],
                                    "chunks": p["chunks"], "chunk_delay": 0.005,
                                    "aux": [p["aux_index"] + 100, 0.5, p["prefix"]]} for p in plans])
    receivers = []
    for p in plans:
        receiver = KVReceiver(decode.mgr, prefill.ready["bootstrap"], p["room"])
        receiver.init()
        receiver.send_metadata(p["dst"], p["aux_index"], p["prefix"])
        receivers.append(receiver)
    poll_until_final(receivers, timeout_s=30)
    outcomes = [(r.poll(), r.failure_exception()) for r in receivers]
    for receiver in receivers:
        receiver.clear()
    report = prefill.result(30)["rooms"]
    got = decode.pool.cpu()
    for p, (state, error) in zip(plans, outcomes, strict=True):
        assert state == KVPoll.Success, error
        assert report[str(p["room"])]["state"] == KVPoll.Success
        # Tokens before the decode's prefix stay as they were (zero); every other one arrived.
        want = src_pool[:, :, p["src"]].clone().reshape(DIMS[0], 2, -1, *DIMS[4:])
        want[:, :, :p["prefix"]] = 0
        assert torch.equal(got[:, :, p["dst"]].reshape(want.shape), want)
        assert unpack_aux(decode.aux, p["aux_index"]) == AuxData(p["aux_index"] + 100, 0.5, p["prefix"])
    untouched = sorted(set(range(DIMS[2])) - {d for p in plans for d in p["dst"]})
    assert not got[:, :, untouched].any()


@needs_cuda
def test_a_killed_decode_is_unmapped_and_its_restart_mapped_anew(spawn_peer, make_rank, bootstrap):
    prefill = make_rank(3, config=IPC, device="cuda")
    prefill.mgr.publish_layout(bootstrap.address)

    def one_room(decode_peer, room: int) -> None:
        sender = KVSender(prefill.mgr, bootstrap.address, room)
        sender.init(2, 0)
        decode_peer.command("recv", bootstrap=bootstrap.address, rooms=[{"room": room, "pages": [5, 6],
                                                                          "aux_index": 1}])
        assert wait_until(lambda: sender.poll() != KVPoll.Bootstrapping, 10)
        sender.send([1, 2], last_chunk=True)
        poll_until_final([sender], 10)
        assert sender.poll() == KVPoll.Success, sender.failure_exception()
        assert decode_peer.result(10)["rooms"][str(room)]["state"] == KVPoll.Success
        sender.clear()

    first = spawn_peer({"role": "decode", "device": "cuda", "transfer": IPC_PEER})
    one_room(first, 11)
    assert prefill.mgr.stats()["mapped_peers"] == 1
    first.kill9()
    second = spawn_peer({"role": "decode", "device": "cuda", "transfer": IPC_PEER})
    one_room(second, 12)
    # Both peers are idle now: each is unmapped a heartbeat timeout after its last room.
    assert wait_until(lambda: prefill.mgr.stats()["mapped_peers"] == 0, 10), prefill.mgr.stats()
