"""The executor's RoPE table (executor/rope.py): a position's cos/sin rows are computed once, in
a call of a fixed shape, and never change as the table grows. Without that, a generation that
crossed the table's size rebuilt it midway, and a rotary call whose rounding depends on its
size (torch splits a large elementwise ``cos`` between threads) gave the same position other
bits before and after: ``ar`` and the method run after it then held different keys for the
same prompt (issue 63's HumanEval/10 parity miss on the 2-core AMX Xeon)."""

import torch

from selfspec.executor.rope import TABLE_BLOCK, RopeTable


class SizeDependentRotary(torch.nn.Module):
    """A rotary module whose rows round differently with the size of the call (as torch's
    threaded ``cos`` can): each value is perturbed by a call-size-dependent amount."""

    rope_type = "default"

    def __init__(self, head_dim: int = 8) -> None:
        super().__init__()
        self.inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        self.calls: list[int] = []

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        n = position_ids.shape[-1]
        self.calls.append(n)
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        wobble = 1e-4 * (n % 7)  # the call's size shows in every value
        return (emb.cos() + wobble).to(x.dtype), (emb.sin() + wobble).to(x.dtype)


def _rows(table: RopeTable, hidden: torch.Tensor, first: int, last: int):
    cos, sin = table.lookup(hidden, torch.arange(first, last)[None])
    return cos.clone(), sin.clone()


def test_rows_never_change_as_the_table_grows():
    rotary = SizeDependentRotary()
    table = RopeTable(rotary)
    hidden = torch.zeros(1, 1, 16)
    before = _rows(table, hidden, 0, 200)           # a 256-position table
    _rows(table, hidden, 0, 300)                    # grows past 256 (a long generation)
    _rows(table, hidden, 1000, 1001)                # and again, by more than doubling
    assert torch.equal(_rows(table, hidden, 0, 200)[0], before[0])
    assert torch.equal(_rows(table, hidden, 0, 200)[1], before[1])
    assert set(rotary.calls) == {TABLE_BLOCK}       # every row from one call of one shape


def test_a_rows_bits_do_not_depend_on_the_growth_history():
    hidden = torch.zeros(1, 1, 16)
    a, b = RopeTable(SizeDependentRotary()), RopeTable(SizeDependentRotary())
    _rows(a, hidden, 0, 10)
    _rows(a, hidden, 0, 700)
    _rows(b, hidden, 1500, 1501)                    # one jump straight to 1,501 positions
    assert torch.equal(_rows(a, hidden, 0, 700)[0], _rows(b, hidden, 0, 700)[0])
    # the values are the module's own (unperturbed by the block size, up to its wobble)
    cos = _rows(b, hidden, 0, 1501)[0][0, :, 0]
    freqs = torch.arange(1501)[:, None].float() * SizeDependentRotary().inv_freq
    want = torch.cat((freqs, freqs), dim=-1).cos() + 1e-4 * (TABLE_BLOCK % 7)
    assert torch.equal(cos, want)


def test_the_fp32_views_follow_the_grown_table():
    table = RopeTable(SizeDependentRotary())
    hidden = torch.zeros(1, 1, 16, dtype=torch.bfloat16)
    cos, _ = table.span(hidden, 250, 4)
    _rows(table, hidden, 0, 600)
    again, _ = table.span(hidden, 250, 4)
    assert torch.equal(cos, again)
    assert torch.equal(again, table.rows(hidden, torch.arange(250, 254)[None])[0])


class FirstCallWrong(SizeDependentRotary):
    """A rotary module whose first call comes out wrong (as torch's first ``cos`` of a process
    sometimes did on the AMX Xeon), the later ones right."""

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        cos, sin = super().forward(x, position_ids)
        if len(self.calls) == 1:
            return cos + 1e-3, sin
        return cos, sin


def test_a_wrong_first_call_is_called_again():
    hidden = torch.zeros(1, 1, 16)
    right, wrong = RopeTable(SizeDependentRotary()), RopeTable(FirstCallWrong())
    assert torch.equal(_rows(wrong, hidden, 0, 100)[0], _rows(right, hidden, 0, 100)[0])
