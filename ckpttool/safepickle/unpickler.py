"""The unpicklers readers use: `RestrictedUnpickler` for any pickle (torch.save records,
object blobs; built by the C unpickler once the loader accepted it), `unpickle_metadata` for a
DCP `.metadata` (built by the loader itself, with its fast paths)."""

from __future__ import annotations

import functools
import io
import pickle
from typing import Any

from ckpttool.core.errors import CorruptMetadata, UnsafeMetadata, clip
from ckpttool.safepickle.allowlist import _ALLOWED, _find_allowed
from ckpttool.safepickle.loader import _Loader, scan_pickle
from ckpttool.safepickle.nodes import PickleRefused, _Fallback


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickler that admits only the names in `allowed`; anything else is refused.

    `load` reads the whole file object and checks it with `scan_pickle` (raising
    `PickleRefused`, an `UnpicklingError`, when it exceeds a budget; see the module docstring)
    before the C unpickler builds anything. Verdicts on small pickles are remembered: the
    torch.save records of a checkpoint repeat a few `data.pkl`s.
    """

    def __init__(
        self,
        file: io.BufferedIOBase,
        allowed: dict[tuple[str, str], Any],
        source: str,
        persistent: Any = None,
    ):
        super().__init__(file)
        self._file = file
        self._allowed = allowed
        self._source = source
        self._persistent = persistent

    def load(self) -> Any:
        """Return the unpickled object, built only after `scan_pickle` accepted the bytes."""
        data = self._file.read()
        if not isinstance(data, bytes):
            data = bytes(data)
        persistent = self._persistent is not None
        if len(_PASSED) >= _PASSED_ALLOWLISTS and (id(self._allowed), persistent) not in _PASSED:
            _PASSED.clear()  # a caller passing a new allowlist each time
        passed = _PASSED.setdefault((id(self._allowed), persistent), (self._allowed, set()))[1]
        if data not in passed:
            scan_pickle(data, self.find_class, persistent=persistent)
            if len(data) <= _PASSED_BYTES:
                if len(passed) >= _PASSED_COUNT:
                    passed.clear()
                passed.add(data)
        super().__init__(io.BytesIO(data))
        return super().load()

    def find_class(self, module: str, name: str) -> Any:
        return _find_allowed(self._allowed, self._source, module, name)

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise UnsafeMetadata(f"{self._source}: unexpected persistent id in pickle")
        return self._persistent(pid)


# small pickles `scan_pickle` accepted, per allowlist (kept alive here) and persistent ids
_PASSED: dict[tuple[int, bool], tuple[dict, set[bytes]]] = {}
_PASSED_BYTES, _PASSED_COUNT, _PASSED_ALLOWLISTS = 4096, 8192, 16


def unpickle_metadata(raw: bytes | bytearray, source: str) -> Any:
    """Return the stand-ins a DCP `.metadata` pickle builds (readers/dcp.py converts them), or
    raise CorruptMetadata or UnsafeMetadata naming `source`; nothing from it is executed."""
    try:
        find_class = functools.partial(_find_allowed, _ALLOWED, source)
        try:
            return _Loader(raw, find_class, build=True).load()
        except _Fallback:
            return RestrictedUnpickler(io.BytesIO(raw), _ALLOWED, source).load()
    except UnsafeMetadata:
        raise
    except PickleRefused as error:
        if error.exhausts:
            raise CorruptMetadata(
                f"{source}: refused: {error}; nothing was built from it (the file is corrupt, "
                "or was crafted to exhaust memory or time)"
            ) from None
        raise CorruptMetadata(
            f"{source}: cannot decode DCP metadata: {error}; the file is truncated or corrupt"
        ) from None
    except Exception as error:  # pickle raises many kinds on truncated or garbage input
        raise CorruptMetadata(
            f"{source}: cannot decode DCP metadata ({type(error).__name__}: {clip(str(error))}); "
            "the file is truncated or not a DCP .metadata file"
        ) from None
