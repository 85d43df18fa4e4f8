"""The messages of asynchronous push-sum (``asynchronous.AsyncPushSum``: a worker's de-biased
model and the weight of the share it stands for) and of asynchronous outer steps
(``outer.asynchronous``: a pseudo-gradient and the inner steps behind it), as one byte buffer of a
size fixed for the job.

Layout: ``[weight | round | aux | values]``, the weight a float64, the sender's round an int64 and
one more float64 of the sender's (an outer step's: its seconds per inner step) at the head, where
every view of the bytes after it stays aligned; the whole of one size for the job, so that a
receiver's posted buffer fits any message of its sender and the mass of the weights is
conserved to float64 rounding whatever the values travel in. The values travel in full
precision, in 16 bits, or block-quantized (int8, int4 or float8 e4m3fn: the compiled engine's
messages, Note [Quantized messages] in csrc/kernels/block_format.h, 0.258, 0.133 and 0.258 of
float32's bytes). A lossy message's rounding stays with its sender (error feedback): the sender
keeps its numerator minus what it really sent, so the sum of all numerators (weight times values)
is conserved to the state's rounding and the error rides along in later messages.

Every pass over the values is one of the compiled engine's fused kernels (``torch.ops.gossip_ext``:
a send is one ``quantize_into_`` or ``compress_into_`` that also keeps the rounding, an absorb one
``absorb_`` or ``absorb_quantized_`` that also checks finiteness), as in the synchronous rounds: a
worker spends its time on its steps, not on its messages (docs/performance.md, "Asynchronous
gossip").

Note [Asynchronous gossip on GPUs]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Asynchronous messages travel over gloo from host memory, also between GPUs, by design rather
than NCCL's point-to-point calls: an NCCL receive is matched and stream-ordered, so a worker that
keeps one posted for each peer's next message (what never waiting takes) would hold a kernel
resident on the GPU per peer until that peer sends, stall every later call on the communicator
behind it, and could be released from a stopped peer only by aborting the communicator. Over gloo
a posted receive costs a host thread, and a timeout names the peer. What crosses PCIe is the
message, not the model: values are encoded and absorbed on the GPU by the same kernels as the
synchronous NCCL rounds, so an int8 message moves a quarter of the parameters' bytes each way,
where the network asynchronous gossip is for is the slower link.
"""

from __future__ import annotations

import math

import torch

from gossip_ext._torch_check import _C

BLOCK = 128  # values per block scale, as kQuantBlock in csrc/kernels/block_format.h
# The head's layout is the compiled mailboxes' (MessageHeader in csrc/transport/mailbox/mailbox.h),
# which read the sender's round from it: the weight (float64), the round (int64), aux (float64).
_WEIGHT, _ROUND, _AUX = (_C.MESSAGE_HEADER[k] for k in ("weight", "round", "aux"))
_HEADER_BYTES = _C.MESSAGE_HEADER["bytes"]
_QUANTIZED = {"int8": "int8", "int4": "int4", torch.float8_e4m3fn: "float8_e4m3fn"}
_SIXTEEN_BITS = (torch.bfloat16, torch.float16)


class Codec:
    """Writes and reads the messages of ``numel`` values held in ``dtype`` (float32 or
    float64) on ``device``, travelling as ``message_dtype``: None (full precision),
    ``torch.bfloat16``, ``torch.float16``, ``"int8"``, ``"int4"`` or ``torch.float8_e4m3fn``.

    Messages are host tensors wherever the values live: they travel over gloo. Values on a GPU
    are encoded and absorbed there by the kernels' CUDA twins, and only the message's bytes
    cross to the host and back (Note [Asynchronous gossip on GPUs])."""

    def __init__(self, numel: int, dtype: torch.dtype, message_dtype=None, device="cpu"):
        self.numel, self.dtype, self.message_dtype = numel, dtype, message_dtype
        self.device = torch.device(device)
        # Compared, not looked up: an unhashable value gets the error below, not a TypeError.
        self._format = next((f for key, f in _QUANTIZED.items() if key == message_dtype), None)
        if message_dtype is None:
            body = numel * torch.empty((), dtype=dtype).element_size()
        elif message_dtype in _SIXTEEN_BITS:
            body = numel * 2
        elif self._format is not None:
            body = _C.quantized_message_bytes(numel, self._format)
        else:
            raise ValueError(
                "message_dtype must be torch.bfloat16, torch.float16, 'int8', 'int4', "
                f"torch.float8_e4m3fn or None (full precision), got {message_dtype!r}"
            )
        self.nbytes = body + _HEADER_BYTES
        # An absorb's 1 / new weight, refilled on the values' device rather than made anew:
        # on a GPU a fill is queued on the stream, where a new tensor would copy from the host.
        self._divisor = torch.empty(1, dtype=torch.float64, device=self.device)

    @property
    def lossless(self) -> bool:
        return self.message_dtype is None

    def encode(
        self,
        values: torch.Tensor,
        weight: float,
        round: int,  # noqa: A002 - the sender's round
        aux: float = 0.0,
        feedback: float = 0.0,
    ) -> torch.Tensor:
        """The message of ``values`` (a flat ``dtype`` tensor), ``weight`` and ``aux`` from the
        sender's ``round``. A lossy message also keeps ``feedback`` times its rounding in
        ``values``, in the same pass: ``values += feedback * (values - read)``, where ``read``
        is what the receiver will read (:meth:`read`)."""
        message = torch.empty(self.nbytes, dtype=torch.uint8)
        message[_WEIGHT : _WEIGHT + 8].view(torch.float64)[0] = weight
        message[_ROUND : _ROUND + 8].view(torch.int64)[0] = round
        message[_AUX : _AUX + 8].view(torch.float64)[0] = aux
        host = message[_HEADER_BYTES:]
        body = host if self.device.type == "cpu" else torch.empty_like(host, device=self.device)
        if self.message_dtype is None:
            body.view(self.dtype).copy_(values)
        elif self._format is None:
            torch.ops.gossip_ext.compress_into_(
                values, body.view(self.message_dtype), 1.0, None, feedback
            )
        else:
            torch.ops.gossip_ext.quantize_into_(values, body, self._format, 1.0, None, feedback)
        if body is not host:
            host.copy_(body)  # waits for the kernel: the bytes must be whole before gloo sends
        return message

    def read(self, message: torch.Tensor) -> torch.Tensor:
        """The values a message carries, as ``dtype`` (a view of the message where they
        travel in ``dtype``)."""
        body = self._body(message)
        if self.message_dtype is None:
            return body.view(self.dtype)
        if self._format is None:
            return body.view(self.message_dtype).to(self.dtype)
        values = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        torch.ops.gossip_ext.absorb_quantized_(values, [body], self._format, 1.0)
        return values

    def absorb(
        self,
        x: torch.Tensor,
        message: torch.Tensor,
        alpha: float,
        new_weight: float,
        nonfinite: torch.Tensor | None = None,
    ) -> None:
        """``x = (alpha * x + values) / new_weight`` in one pass, with ``values`` the message's
        as :meth:`read` gives them; ``nonfinite`` (a one-element int32 tensor) is set where
        ``x`` or the values hold a NaN or an Inf."""
        body = self._body(message)
        divisor = self._divisor.fill_(new_weight)
        if self._format is None:
            values = body.view(self.dtype if self.message_dtype is None else self.message_dtype)
            torch.ops.gossip_ext.absorb_(x, [values], alpha, None, divisor, nonfinite)
        else:
            torch.ops.gossip_ext.absorb_quantized_(
                x, [body], self._format, alpha, None, divisor, nonfinite
            )

    def values_finite(self, message: torch.Tensor, values: torch.Tensor) -> bool:
        """Whether ``values``, which ``message`` was just encoded from, hold no NaN or Inf. A
        block-quantized message answers from its scales alone (a block holding one has a NaN
        scale); otherwise one reduction over the values, which a NaN or an Inf turns to one."""
        if self._format is not None:
            blocks = math.ceil(self.numel / BLOCK)
            scales = message[_HEADER_BYTES : _HEADER_BYTES + 4 * blocks].view(torch.float32)
            return bool(torch.isfinite(scales).all())
        # A float64 sum of float32 values cannot overflow; of float64 ones only near 1e300.
        return math.isfinite(float(values.sum(dtype=torch.float64)))

    def _body(self, message: torch.Tensor) -> torch.Tensor:
        """The bytes after a (host) message's header, on the values' device."""
        return message[_HEADER_BYTES:].to(self.device)


def flatten(tensors, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """``tensors`` as one flat ``dtype`` copy, in order: the values a message is made of. Into
    ``out`` where given (a worker's buffer for every step: a fresh one each time costs ten times
    the copy, in the page faults of its first touch)."""
    flat = [t.detach().reshape(-1) for t in tensors]
    if out is None:
        return torch.cat([t.to(dtype) for t in flat])
    if all(t.dtype == out.dtype for t in flat):
        return torch.cat(flat, out=out)
    for values, t in zip(out.split([t.numel() for t in flat]), flat):
        values.copy_(t)
    return out


def write_flat(tensors, flat: torch.Tensor) -> None:
    """Writes ``flat`` (as :func:`flatten` laid it out) back into ``tensors``, in place."""
    with torch.no_grad():
        for tensor, values in zip(tensors, flat.split([t.numel() for t in tensors])):
            tensor.copy_(values.view_as(tensor))


def round_of(message: torch.Tensor) -> int:
    """The sender's round a message (of any codec) carries."""
    return int(message[_ROUND : _ROUND + 8].view(torch.int64)[0])


def weight_of(message: torch.Tensor) -> float:
    """The weight a message (of any codec) carries."""
    return float(message[_WEIGHT : _WEIGHT + 8].view(torch.float64)[0])


def aux_of(message: torch.Tensor) -> float:
    """The sender's ``aux`` value a message (of any codec) carries."""
    return float(message[_AUX : _AUX + 8].view(torch.float64)[0])
