"""The aux slot's packed struct."""

from __future__ import annotations

import pytest

from splitserve.transfer import AUX_BYTES, AuxData, AuxReader, AuxWriter, make_aux_tensor, pack_aux, unpack_aux


def test_aux_round_trips_in_its_slot_only():
    aux = make_aux_tensor(4, slot_bytes=16)
    pack_aux(aux, 2, AuxData(151643, -0.015625, 17))
    assert unpack_aux(aux, 2) == AuxData(151643, -0.015625, 17)
    assert AUX_BYTES == 12 and aux[[0, 1, 3]].sum() == 0 and aux[2, 12:].sum() == 0


def test_the_writer_packs_host_slots_as_pack_aux_does():
    aux, want = make_aux_tensor(4, slot_bytes=16), make_aux_tensor(4, slot_bytes=16)
    AuxWriter(aux).write(1, AuxData(7, 0.5, 3))
    pack_aux(want, 1, AuxData(7, 0.5, 3))
    assert aux.equal(want) and unpack_aux(aux, 1) == AuxData(7, 0.5, 3)


def test_the_reader_reads_host_slots_as_unpack_aux_does():
    aux = make_aux_tensor(4, slot_bytes=16)
    pack_aux(aux, 3, AuxData(9, -1.25, 2))
    reader = AuxReader(aux)
    assert reader.read(3) == unpack_aux(aux, 3) == AuxData(9, -1.25, 2) and reader.read(0) == AuxData(0, 0.0, 0)


def test_slots_smaller_than_the_struct_are_refused():
    with pytest.raises(ValueError):
        make_aux_tensor(4, slot_bytes=8)
