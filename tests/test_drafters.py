"""Drafters: n-gram prompt lookup and the draft model's ragged catch-up."""

from __future__ import annotations

import pytest

from specdec.models.loading import tiny_random
from specdec.runtime.backends.torch_backend import TorchBackend
from specdec.runtime.drafters import ModelDrafter, NgramDrafter
from specdec.runtime.request import Request, SeqState


def seq_of(tokens: list[int], slot: int = 0) -> SeqState:
    state = SeqState.start(Request(tokens[:1], max_tokens=100), slot)
    state.tokens = list(tokens)
    return state


def test_ngram_copies_the_continuation_of_the_most_recent_match() -> None:
    drafter = NgramDrafter(max_ngram=3, min_ngram=2)
    seq = seq_of([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3])
    # the last 3-gram (1, 2, 3) occurred twice before; the most recent one is followed by 7 8 5
    assert drafter.propose([seq], [2])[0].tokens == [7, 8]
    assert drafter.propose([seq], [5])[0].tokens == [7, 8, 5, 1, 2]
    assert drafter.propose([seq], [0])[0].tokens == []


def test_ngram_falls_back_to_shorter_ngrams_and_never_matches_itself() -> None:
    drafter = NgramDrafter(max_ngram=3, min_ngram=2)
    seq = seq_of([4, 5, 6, 0, 5, 6])
    assert drafter.propose([seq], [3])[0].tokens == [0, 5, 6]  # 2-gram (5, 6) matched at position 2
    lonely = seq_of([1, 2, 3, 4])
    assert drafter.propose([lonely], [3])[0].tokens == []  # the suffix itself is not a match


def test_ngram_index_grows_incrementally_with_the_output() -> None:
    drafter = NgramDrafter(max_ngram=2, min_ngram=1)
    seq = seq_of([1, 2, 3])
    assert drafter.propose([seq], [2])[0].tokens == []
    seq.tokens += [1, 2, 4, 1]
    assert drafter.propose([seq], [2])[0].tokens == [2, 4]
    drafter.release(seq)
    assert drafter.propose([seq_of([7, 7])], [1])[0].tokens == [7]


def test_ngram_draft_lengths_vary_per_sample_and_respect_k() -> None:
    drafter = NgramDrafter()
    seqs = [seq_of([1, 2, 3, 1, 2, 3, 4, 5, 6, 1, 2, 3]), seq_of([5, 6, 7]), seq_of([3, 3, 3, 3])]
    lengths = [len(d.tokens) for d in drafter.propose(seqs, [4, 4, 1])]
    assert lengths == [4, 0, 1]


class RowSpy:
    """Wraps a backend and records the tokens each sequence fed in every step."""

    def __init__(self, backend: TorchBackend) -> None:
        self.backend, self.fed = backend, []
        self.vocab_size = backend.vocab_size
        self.rows_processed = self.calls = 0

    def allocate_cache(self, num_slots: int, max_len: int):
        return self.backend.allocate_cache(num_slots, max_len)

    def step(self, batch, cache):
        cu = batch.cu_seqlens.tolist()
        self.fed.append([cu[i + 1] - cu[i] for i in range(len(cu) - 1)])
        return self.backend.step(batch, cache)


def test_model_drafter_catch_up_feeds_two_tokens_only_where_all_drafts_were_accepted() -> None:
    model = tiny_random(seed=4, vocab_size=32, num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1)
    spy = RowSpy(TorchBackend(model))
    drafter = ModelDrafter(spy, max_batch=2, max_len=64)
    a, b = seq_of([1, 2, 3, 4, 5], slot=0), seq_of([6, 7, 8], slot=1)
    first = drafter.propose([a, b], [3, 3])
    assert spy.fed == [[5, 3], [1, 1], [1, 1]]  # prompt tails, then one token per draft step
    # a accepted all 3 drafts (+ bonus 9); b accepted none (correction 0)
    a.tokens += [*first[0].tokens, 9]
    b.tokens += [0]
    spy.fed.clear()
    drafter.propose([a, b], [2, 2])
    assert spy.fed == [[2, 1], [1, 1]]  # only a feeds 2 tokens: its last draft and the bonus
    # a draft of k = 0 takes no part in draft steps; b alone drafts
    spy.fed.clear()
    a.tokens += [3]
    drafts = drafter.propose([a, b], [0, 1])
    assert drafts[0].tokens == [] and len(drafts[1].tokens) == 1 and spy.fed == [[1]]


@pytest.mark.parametrize("k", [1, 4])
def test_model_drafter_greedy_drafts_equal_the_draft_models_own_greedy_chain(k: int) -> None:
    model = tiny_random(seed=8, vocab_size=32, num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1)
    backend = TorchBackend(model)
    drafter = ModelDrafter(backend, max_batch=1, max_len=64)
    seq = seq_of([3, 1, 4, 1, 5])
    proposal = drafter.propose([seq], [k])[0].tokens
    hf = model.to_hf()
    import torch

    ids = torch.tensor([seq.tokens])
    chain = hf.generate(ids, max_new_tokens=k, do_sample=False, pad_token_id=0)[0, ids.shape[1] :].tolist()
    assert proposal == chain
