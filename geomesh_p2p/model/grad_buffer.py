"""One fp32 CPU ``[P]`` buffer for a trainer's gradients and, between its runs of inner steps, the round's
pseudo-gradient (issue 27, session 39).

Before, each inner step's ``zero_grad(set_to_none=True)`` freed the gradients, the first backward of the next
step allocated them again, and after the round's steps the pseudo-gradient allocated a fresh ``[P]`` (which the
exchange turns into the aggregate, in place): ~1P of page faults twice a round (0.13-0.19 s at ``gpt2-124m``)
and, in glibc's heap, blocks that stay resident until a trim. Here the gradients are views of one flat buffer,
zeroed before each step, and once the steps are over the same buffer takes the pseudo-gradient
(:meth:`FlatGradBuffer.take`). Whoever holds the round's update or aggregate afterwards (the exchange, the outer
step, the update log until it is spilled, verified work) holds a view of it; when the next steps begin, the
buffer is used again only if nothing else references its storage (:func:`storage_shared`), else a fresh one
takes its place and the old one lives on with its holders. So a round never holds more ``[P]`` than before, and
one fewer once the holders let go before the next steps.

Bitwise the same training: a backward into a zeroed gradient adds ``0 + g`` (= ``g`` but for the sign of a zero,
which no optimizer here reads: AdamW's moments and the clip's norm give the same bits). A parameter that gets
no gradient in a step would keep a zeroed one instead of none (AdamW would then decay it and move its moments):
each parameter's post-accumulate hook marks the steps whose backward reached it, and a step pre-hook on the
optimizer sets the gradient of every unmarked one to None before the step, as ``zero_grad(set_to_none=True)``
would have left it (red team 39's xfail, fixed in session 40). The trainer calls that
(:meth:`FlatGradBuffer.settle`) before its clip as well: a zero there instead of nothing in the clip's norms
sums them in another order (red team 40). The hooks hold the marks, not the buffer, and go with it. The buffer
is only used once a step gave every parameter a gradient (:meth:`FlatGradBuffer.zero`), else never.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Callable, Optional, Sequence

import torch
from torch.utils.hooks import RemovableHandle

__all__ = ["FlatGradBuffer", "storage_shared"]


def _use_count(t: torch.Tensor) -> Optional[int]:
    """References to ``t``'s storage (tensors and the storage's Python object), or None where torch does not say."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return None
    return int(count(t.untyped_storage()._cdata))


def storage_shared(t: torch.Tensor) -> bool:
    """True unless ``t`` is the only tensor on its storage (views, ``detach()`` copies, numpy arrays and memoryviews
    made from it, and its storage object held by anyone, all count); True as well where torch cannot say (then
    nothing is reused)."""
    n = _use_count(t)
    # t itself and the storage's Python object, which untyped_storage() above keeps alive while it is read
    if n is None or n > 2:
        return True
    # torch keeps one Python object per storage: a holder of the storage object alone (not of a tensor) is one
    # C++ reference for all of them, so counted above only as the object's own. Its Python references tell
    # (red team 39: an aggregate held so was overwritten), over those of a storage nobody holds (_PY_REFS).
    return _storage_py_refs(t) > _PY_REFS


def _storage_py_refs(t: torch.Tensor) -> int:
    st = t.untyped_storage()
    return sys.getrefcount(st)


#: :func:`_storage_py_refs` of a tensor's storage that nobody else holds (this torch's own references included)
_PY_REFS = _storage_py_refs(torch.zeros(1))


class FlatGradBuffer:
    """The gradients of ``params`` as views of one fp32 CPU ``[P]`` buffer (layout of
    :func:`~geomesh_p2p.model.build.flat_params` when ``params`` are the model's parameters in order).

    ``enabled=False`` (a device other than the CPU, non-fp32 or sharded parameters): :meth:`zero` is
    ``zero_grad(set_to_none=True)`` and :meth:`take` None, as without this class."""

    def __init__(self, params: Sequence[torch.nn.Parameter], *, enabled: bool = True):
        self.params = list(params)
        self.numel = sum(p.numel() for p in self.params)
        self.enabled = bool(enabled) and all(
            type(p.data) is torch.Tensor
            and p.device.type == "cpu"
            and p.dtype == torch.float32
            and p.requires_grad
            and p.is_contiguous()
            for p in self.params
        )
        self._checked = False  # a step gave every parameter a gradient (see the module's docstring)
        self._buf: Optional[torch.Tensor] = None
        #: times a fresh buffer was allocated (the first one included): a reused buffer keeps it unchanged
        self.allocations = 0
        #: called (in the steps' thread) when the buffer is still held elsewhere as the next steps begin, before a
        #: fresh one is made: a holder that lets it go soon is waited for, bounded by the callable (the node: the
        #: outer update's spill to disk, which reads the aggregate, this buffer; issue 27, session 45). None: none.
        self.wait_release: Optional[Callable[[], object]] = None
        self._touched = [False] * len(self.params)  # this step's backward reached params[i] (its hook ran)
        self._param_hooks: list[RemovableHandle] = []  # the parameters' post-accumulate hooks
        self._step_hook: Optional[RemovableHandle] = None  # the step pre-hook, on the optimizer _armed refers to
        self._armed: Optional[weakref.ref] = None

    def settle(self) -> None:
        """After a step's backward passes, before its clip and step: a parameter they did not reach gets no
        gradient (None), as ``zero_grad(set_to_none=True)`` would have left it. The optimizer's step pre-hook
        calls it too, but a clip before the step would see the zeroed view: its norm (0.0) joins the list of
        per-tensor norms, which then sums in another order (other last bits of the clip's factor, red team 40)."""
        if self.enabled and self._checked:
            for p, touched in zip(self.params, self._touched):
                if not touched:
                    p.grad = None

    def _settle(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        """The optimizer's step pre-hook: :meth:`settle`."""
        self.settle()

    def _arm(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._param_hooks:
            # The hooks hold the marks, never the buffer: Python's cycle collector does not see a parameter's
            # post-accumulate hooks, so hooks holding the buffer (which holds the parameters) kept a dropped
            # trainer's weights and buffer for good (red team 40). Removed once the buffer is freed.
            self._param_hooks = [p.register_post_accumulate_grad_hook(_marker(self._touched, i))
                                 for i, p in enumerate(self.params)]  # fmt: skip
            weakref.finalize(self, _remove_all, self._param_hooks)
        if self._armed is None or self._armed() is not optimizer:  # the first optimizer, or a rebuilt one
            if self._step_hook is not None:
                self._step_hook.remove()
            self._step_hook = optimizer.register_step_pre_hook(self._settle)
            self._armed = weakref.ref(optimizer)

    def _free_buffer(self) -> torch.Tensor:
        """The buffer when nothing else holds its storage (after :attr:`wait_release`, when it is held), else a fresh
        one (the old one left to its holders)."""
        if self._buf is not None and self.wait_release is not None and storage_shared(self._buf):
            self.wait_release()
        if self._buf is None or storage_shared(self._buf):
            self._buf = None  # dropped before the fresh one is made: freed now when nothing holds it any more
            self._buf = torch.empty(self.numel, dtype=torch.float32)
            self.allocations += 1
        return self._buf

    def zero(self, optimizer: torch.optim.Optimizer) -> None:
        """Before an inner step: the gradients zeroed, as views of the buffer once that is known to be safe;
        else ``optimizer.zero_grad(set_to_none=True)``."""
        if self.enabled and not self._checked:
            got = [p.grad is not None for p in self.params]
            if all(got):
                self._checked = True
            elif any(got):  # a parameter without a gradient: zeros would change what the optimizer does
                self.enabled = False
        if not (self.enabled and self._checked):
            optimizer.zero_grad(set_to_none=True)
            return
        self._arm(optimizer)
        self._touched[:] = [False] * len(self.params)  # in place: the hooks hold this list
        buf = self._buf
        if buf is None or any(p.grad is None or not _is_view_of(p.grad, buf) for p in self.params):
            for p in self.params:
                p.grad = None
            buf = self._free_buffer()
            off = 0
            for p in self.params:
                n = p.numel()
                p.grad = buf[off : off + n].view_as(p)
                off += n
        with torch.no_grad():
            buf.zero_()

    def take(self) -> Optional[torch.Tensor]:
        """After the steps (the gradients released, ``.grad`` None): a view of the buffer for the round's
        pseudo-gradient, fp32 ``[P]`` (its values are garbage: the caller overwrites all of them), or None when
        the buffer is off or a gradient is still set (the caller then allocates one)."""
        if not (self.enabled and self._checked) or any(p.grad is not None for p in self.params):
            return None
        return self._free_buffer().view(-1)

    def release(self) -> None:
        """Drop the buffer (the trainer's share of it; its holders keep theirs)."""
        self._buf = None

    def drop(self, optimizer: torch.optim.Optimizer) -> None:
        """The gradients freed (``zero_grad(set_to_none=True)``) and the buffer with them (:meth:`release`): after an
        out-of-memory error, so the retry's gradients are the only ``[P]`` of them (the next :meth:`zero` takes a
        buffer again)."""
        optimizer.zero_grad(set_to_none=True)
        self.release()


def _marker(touched: list[bool], i: int) -> Callable[[torch.Tensor], None]:
    """The post-accumulate hook of the ``i``-th parameter: marks ``touched[i]``."""

    def mark(_param: torch.Tensor) -> None:
        touched[i] = True

    return mark


def _remove_all(handles: list[RemovableHandle]) -> None:
    for h in handles:
        h.remove()


def _is_view_of(t: torch.Tensor, buf: torch.Tensor) -> bool:
    return t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
