"""A step's greedy choice per row (id, top-2 margin, finiteness): read on the host, or read back asynchronously
while the next step is launched from the device's own choice (the greedy loop's lookahead,
:func:`stagereplay.decode.greedy.decode_rows`). Knows nothing of boundaries, stages or constructions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

# torch is imported where the choice is computed: see stagereplay.decode.greedy
if TYPE_CHECKING:
    import torch


def choice_on_device(logits: torch.Tensor):
    """Per row: greedy id (lowest index on ties), top-2 margin, all finite; on the logits' device."""
    import torch

    top = torch.topk(logits, 2, dim=-1)
    return torch.argmax(logits, dim=-1), top.values[:, 0] - top.values[:, 1], torch.isfinite(logits).all(dim=-1)


def greedy_choice(logits: torch.Tensor):
    """Per row: greedy id (lowest index on ties), top-2 margin, all finite; on the host (from a GPU in one copy,
    :func:`packed_choice`)."""
    choice, margin, finite = choice_on_device(logits)
    if not logits.is_cuda:
        return choice, margin, finite
    host = packed_choice(choice, margin, finite).cpu()
    return host[0].long(), host[1].to(margin.dtype), host[2].bool()


def packed_choice(choice: torch.Tensor, margin: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """The three per-row values in one float64 tensor (3, rows), so that one copy brings them to the host: ids
    and fp32 margins are exact in float64."""
    import torch

    return torch.stack([choice.double(), margin.double(), finite.double()])


class Lookahead:
    """The greedy choice read back asynchronously, and the next step's ids guessed on the device meanwhile.

    ``forced[r]``: the ids row r is teacher-forced through from the first iteration (in the lockstep schedule),
    else None. ``read(logits)`` queues each row's choice, margin and finiteness (the values :func:`greedy_choice`
    gives) and their copy to the host; ``guess(i)`` is iteration ``i``'s feed as the device knows it (a
    teacher-forced id while the row is in its given stage, else the greedy choice); ``wait()`` blocks until the
    copy is done.
    """

    def __init__(self, forced: list[list[int] | None], device: torch.device):
        import torch

        width = max([len(ids) for ids in forced if ids is not None], default=1)
        padded, lengths = [[0] * width for _ in forced], [0] * len(forced)
        for r, ids in enumerate(forced):
            if ids is not None:
                padded[r][:len(ids)] = ids
                lengths[r] = len(ids)
        self.forced = torch.tensor(padded, dtype=torch.long, device=device)
        self.lengths = torch.tensor(lengths, dtype=torch.long, device=device)
        self.width = width
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.host = torch.empty((3, len(forced)), dtype=torch.float64, pin_memory=True)
            self.event = torch.cuda.Event()

    def read(self, logits: torch.Tensor) -> None:
        self.choice, margin, finite = choice_on_device(logits)
        packed = packed_choice(self.choice, margin, finite)
        if self.cuda:
            self.host.copy_(packed, non_blocking=True)
            self.event.record()
        else:
            self.host = packed

    def guess(self, i: int) -> torch.Tensor:
        import torch

        return torch.where(self.lengths > i, self.forced[:, min(i, self.width - 1)], self.choice)

    def wait(self):
        if self.cuda:
            self.event.synchronize()
        return self.host[0].long(), self.host[1].float(), self.host[2].bool()
