import torch

from stacx.parallel.cp_layout import (
    cp_padded_lengths,
    cu_seqlens,
    local_positions,
    pad_packed,
    position_ids,
    sequence_parallel_padding,
)


def test_load_balanced_chunks_cover_every_position_once():
    padded = cp_padded_lengths([5, 8, 1], cp_size=2)
    assert padded == [8, 8, 4]
    ranks = [local_positions(padded, r, 2) for r in range(2)]
    assert ranks[0].tolist()[:4] == [0, 1, 6, 7]  # sequence 0: chunks 0 and 3
    assert ranks[1].tolist()[:4] == [2, 3, 4, 5]  # sequence 0: chunks 1 and 2
    assert sorted(torch.cat(ranks).tolist()) == list(range(sum(padded)))


def test_positions_and_padding():
    assert cu_seqlens([3, 2]).tolist() == [0, 3, 5]
    assert position_ids([3, 2]).tolist() == [0, 1, 2, 0, 1]
    values = torch.tensor([1, 2, 3, 4, 5])
    assert pad_packed(values, [3, 2], [4, 4], fill=-1).tolist() == [1, 2, 3, -1, 4, 5, -1, -1]


def test_sequence_parallel_padding_completes_each_cp_rank_row_to_a_multiple_of_tp():
    for tp in (1, 2, 3, 4):
        for cp in (1, 2, 3):
            multiple = 2 * cp if cp > 1 else 1
            for lengths in ([5], [9, 5], [12], [7, 10, 3]):
                num_local = sum(cp_padded_lengths(lengths, cp)) // cp
                padding = sequence_parallel_padding(num_local, tp, cp)
                assert padding % multiple == 0  # itself a valid CP-padded sequence
                assert (num_local + padding // cp) % tp == 0
                assert padding // cp < 2 * tp  # never more than two rounds of tp per rank
                if num_local % tp == 0:
                    assert padding == 0
