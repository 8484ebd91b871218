"""How a process that ran the learner's code talks to the grader: plain data over a pipe, never a pickle.

A process that imported the learner's code may have been rewritten by it, so nothing it sends can be
allowed to run code where the grade is decided. It sends JSON lines, and tensors as their raw bytes
(:func:`encode` / :func:`decode`): unpickling a learner's message could run anything, decoding JSON
runs nothing. Every line starts with a **nonce** the grader drew for that process before it forked it;
the learner's code can write to the pipe (it holds the file descriptor) but does not know the nonce
(nothing it can reach holds it: no module global, and frames and the garbage collector are refused to
it, :mod:`ddpkit.exercises.confine`), so a line it writes, or a line it splits by writing half of one,
shows as tampering (:class:`Inbox`), never as a verdict.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import threading

import torch

MAX_BYTES = 256 * 2**20  # one process's messages, at most: a learner's endless output is not read forever

_DTYPES = {str(t): t for t in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                               torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64)}


def encode(value, depth: int = 0):
    """``value`` as JSON-able data: containers, numbers, strings and CPU tensors (by their bytes). Anything
    else becomes its type's name (a grader's worker returns plain data; a learner's object is not shipped)."""
    if depth > 64:
        raise ValueError("data nested more than 64 deep")
    if value is None or type(value) in (bool, int, float, str):
        return value
    if isinstance(value, torch.Tensor):
        with torch._C.DisableTorchFunctionSubclass():  # a subclass's own methods do not run here
            t = torch.Tensor.detach(value).cpu().contiguous()
            data = bytes(t.view(torch.uint8).reshape(-1).numpy()) if t.numel() else b""
        return {"__tensor__": str(t.dtype), "shape": list(t.shape), "data": base64.b64encode(data).decode()}
    if isinstance(value, (list, tuple)):
        items = [encode(v, depth + 1) for v in list(value)]
        return items if isinstance(value, list) else {"__tuple__": items}
    if isinstance(value, dict):
        pairs = list(dict(value).items())
        if all(type(k) is str for k, _ in pairs):
            return {"__dict__": {k: encode(v, depth + 1) for k, v in pairs}}
        return {"__pairs__": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in pairs]}
    for plain in (bool, int, float, str):  # a subclass (an IntEnum, numpy's float64): its plain value
        if isinstance(value, plain):
            return plain(value)
    if type(value).__module__ == "numpy" and hasattr(value, "item"):  # numpy's other scalars
        return encode(value.item(), depth + 1)
    return {"__object__": type(value).__name__[:60]}


def decode(data):
    """The value :func:`encode` made (tensors rebuilt from their bytes; unknown objects as their type's name)."""
    if isinstance(data, list):
        return [decode(v) for v in data]
    if not isinstance(data, dict):
        return data
    if "__tensor__" in data:
        dtype = _DTYPES.get(data["__tensor__"])
        shape = [int(n) for n in data["shape"]]
        raw = base64.b64decode(data["data"])
        if dtype is None or any(n < 0 for n in shape):
            raise ValueError("a tensor of an unknown kind")
        numel = 1
        for n in shape:
            numel *= n
        size = torch.empty((), dtype=dtype).element_size()
        if len(raw) != numel * size:
            raise ValueError("a tensor whose bytes do not fill its shape")
        if not raw:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape).clone()
    if "__tuple__" in data:
        return tuple(decode(v) for v in data["__tuple__"])
    if "__dict__" in data:
        return {k: decode(v) for k, v in data["__dict__"].items()}
    if "__pairs__" in data:
        return {_hashable(decode(k)): decode(v) for k, v in data["__pairs__"]}
    if "__object__" in data:
        return Unshipped(str(data["__object__"]))
    raise ValueError("unknown data")


def _hashable(key):
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


class Unshipped(str):
    """What the grader sees of an object that is not plain data: its type's name."""


def senders(fd: int, nonce: str):
    """``(send, report)`` for a process that will run the learner's code, made before that code loads.

    ``send(kind, payload)`` writes one line of :func:`encode`'d data; ``report(kind, text)`` (the guard's)
    one ``finding`` line, ``text`` a string or a list of strings (a file event). Both hold what they use
    (``os.write``, ``json.dumps``, a lock shared by the two, the nonce) in their closure: the nonce is
    never handed to a function that could have been rewritten, and rewriting a module or a class later
    does not reach them. Lines are written whole, one at a time, from any thread."""
    write, dumps, lock, to_data = os.write, json.dumps, threading.Lock(), encode
    head = nonce.encode() + b" "

    def put(line: bytes) -> None:
        with lock:
            view = memoryview(line)
            while view:
                view = view[write(fd, view):]

    def send(kind: str, payload) -> None:
        body = dumps(to_data(payload), separators=(",", ":")).encode()
        put(head + kind.encode() + b" " + body + b"\n")

    def report(kind: str, text) -> None:
        body = "\x1f".join(text) if type(text) is list else str(text)
        put(head + b"finding " + kind.encode().hex().encode() + b" " + body.encode(errors="replace").hex().encode() + b"\n")

    return send, report


class Inbox:
    """The receiving end, in the grader's process: collects lines, and notices any it did not expect."""

    def __init__(self, fd: int, nonce: str) -> None:
        self.fd, self.nonce = fd, nonce
        self.buffer, self.size, self.closed, self.tampered = b"", 0, False, False
        self.messages: list[tuple[str, object]] = []

    def pump(self) -> bool:
        """Read what is there (the fd is readable); False once the other end is closed."""
        try:
            chunk = os.read(self.fd, 1 << 20)
        except BlockingIOError:
            return True
        if not chunk:
            self.closed = True
            if self.buffer:
                self.tampered = True
            return False
        self.size += len(chunk)
        if self.size > MAX_BYTES:
            self.tampered, self.closed = True, True
            return False
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        for line in lines:
            self._take(line)
        return True

    def _take(self, line: bytes) -> None:
        head, _, rest = line.partition(b" ")
        if head.decode(errors="replace") != self.nonce:
            self.tampered = True
            return
        kind, _, body = rest.partition(b" ")
        try:
            if kind == b"finding":
                what, _, text = body.partition(b" ")
                what, text = bytes.fromhex(what.decode()).decode(), bytes.fromhex(text.decode()).decode()
                self.messages.append(("finding", [what, text.split("\x1f") if what == "file" else text]))
            else:
                self.messages.append((kind.decode(), decode(json.loads(body))))
        except (ValueError, TypeError, KeyError, RecursionError, UnicodeDecodeError):
            self.tampered = True

    def of(self, kind: str) -> list:
        return [payload for k, payload in self.messages if k == kind]


def pipe() -> tuple[int, int, str]:
    """A pipe (read end, write end) and a fresh nonce for it."""
    read, write = os.pipe()
    return read, write, secrets.token_hex(16)


def read_all(inbox: Inbox) -> Inbox:
    """Block until the sending end is closed (every writer gone); return the inbox."""
    while inbox.pump():
        pass
    return inbox
