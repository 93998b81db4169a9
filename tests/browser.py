"""A real headless Chromium for tests, driven over the DevTools protocol through a pipe.

Chromium's `--remote-debugging-pipe` reads protocol messages from fd 3 and writes them to fd 4,
each ended by a NUL byte: no websocket, no port, no dependency beyond the browser itself
(Debian's `chromium` package; set CKPTTOOL_CHROMIUM to use another binary).

Example:
    >>> with Browser.launch(tmp_path) as browser:
    ...     browser.open(page_path)
    ...     browser.evaluate("document.title")
    ...     browser.screenshot(tmp_path / "page.png")
"""

from __future__ import annotations

import base64
import json
import os
import queue
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")  # Debian's package installs /usr/bin/chromium
TIMEOUT = 20.0  # seconds any one protocol command may take


def find_chromium() -> str | None:
    """Return the browser to use (CKPTTOOL_CHROMIUM, else the first of CHROMIUM_NAMES on PATH), or None."""
    if os.environ.get("CKPTTOOL_CHROMIUM"):
        return shutil.which(os.environ["CKPTTOOL_CHROMIUM"])
    return next((path for name in CHROMIUM_NAMES if (path := shutil.which(name))), None)


class BrowserError(RuntimeError):
    pass


class Browser:
    """One headless Chromium with one page (a target attached in flat mode). Console errors,
    uncaught exceptions and error log entries (a CSP refusal, a failed load) land in `errors`."""

    def __init__(self, process: subprocess.Popen, to_browser: int, from_browser: int):
        self.process, self._out, self._in = process, to_browser, from_browser
        self._next_id = 0
        self._lock = threading.Lock()
        self._waiting: dict[int, queue.Queue] = {}
        self.events: queue.Queue = queue.Queue()
        self.errors: list[str] = []
        self.session: str | None = None
        threading.Thread(target=self._read, daemon=True).start()

    @classmethod
    def launch(cls, profile: Path, executable: str | None = None, width: int = 1280, height: int = 900) -> "Browser":
        """Start Chromium headless with a fresh profile in `profile`, and open a blank page."""
        executable = executable or find_chromium()
        if executable is None:
            raise BrowserError("no chromium found (apt-get install chromium)")
        to_child_read, to_child_write = os.pipe()
        from_child_read, from_child_write = os.pipe()

        def at_fds_3_and_4() -> None:  # in the child, before exec
            read, write = os.dup(to_child_read), os.dup(from_child_write)
            os.dup2(read, 3)
            os.dup2(write, 4)

        profile.mkdir(parents=True, exist_ok=True)
        arguments = [executable, "--headless=new", "--remote-debugging-pipe", f"--user-data-dir={profile}",
                     "--no-sandbox",  # tests run as root in containers, where the sandbox cannot start
                     "--disable-gpu", "--no-first-run", "--no-default-browser-check", "--disable-extensions",
                     "--disable-background-networking", "--disable-component-update", "--disable-sync",
                     "--hide-scrollbars", "--mute-audio", f"--window-size={width},{height}", "about:blank"]
        process = subprocess.Popen(arguments, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, pass_fds=(3, 4), preexec_fn=at_fds_3_and_4)
        os.close(to_child_read)
        os.close(from_child_write)
        browser = cls(process, to_child_write, from_child_read)
        try:
            target = browser.send("Target.createTarget", url="about:blank")["targetId"]
            browser.session = browser.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
            for domain in ("Page", "Runtime", "Log"):
                browser.send(f"{domain}.enable")
            browser.send("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
        except BaseException:
            browser.close()
            raise
        return browser

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """End the browser (this process only, by its own handle)."""
        if self.process.poll() is None:
            try:
                self._write({"id": 0, "method": "Browser.close"})
                self.process.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        for fd in (self._out, self._in):
            try:
                os.close(fd)
            except OSError:
                pass

    # -- the protocol ------------------------------------------------------------------------

    def _write(self, message: dict) -> None:
        data = json.dumps(message).encode() + b"\0"
        with self._lock:
            while data:
                data = data[os.write(self._out, data):]

    def _read(self) -> None:
        buffer = b""
        while True:
            try:
                data = os.read(self._in, 1 << 16)
            except OSError:
                data = b""
            if not data:
                for waiting in list(self._waiting.values()):
                    waiting.put({"error": {"message": "the browser closed the pipe"}})
                return
            buffer += data
            *messages, buffer = buffer.split(b"\0")
            for raw in messages:
                message = json.loads(raw)
                if "id" in message and message["id"] in self._waiting:
                    self._waiting.pop(message["id"]).put(message)
                elif "method" in message:
                    self._event(message)

    def _event(self, message: dict) -> None:
        method, params = message["method"], message.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            self.errors.append("console: " + " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", [])))
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            self.errors.append("exception: " + str(details.get("exception", {}).get("description") or details.get("text")))
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            self.errors.append("log: " + params["entry"].get("text", ""))
        self.events.put(message)

    def send(self, method: str, **params: Any) -> dict:
        """Run one protocol command (on the page's session once attached); return its result."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if self.session is not None and not method.startswith(("Target.", "Browser.")):
            message["sessionId"] = self.session
        answer: queue.Queue = queue.Queue()
        self._waiting[self._next_id] = answer
        self._write(message)
        try:
            reply = answer.get(timeout=TIMEOUT)
        except queue.Empty:
            raise BrowserError(f"{method}: no answer in {TIMEOUT:.0f} s") from None
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error'].get('message')}")
        return reply.get("result", {})

    # -- what tests do -----------------------------------------------------------------------

    def open(self, path: Path, ready: str = "document.body && document.body.dataset.ready === 'true'") -> None:
        """Load a local file and wait until `ready` (JS) is true."""
        self.send("Page.navigate", url=Path(path).resolve().as_uri())
        self.wait_for(ready)

    def wait_for(self, condition: str, timeout: float = TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not self.evaluate(f"Boolean({condition})"):
            if time.monotonic() > deadline:
                raise BrowserError(f"not true after {timeout:.0f} s: {condition} (errors: {self.errors})")
            time.sleep(0.05)

    def evaluate(self, expression: str) -> Any:
        """Return the value of a JS expression in the page (JSON-serialisable values)."""
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression[:80]}: {result['exceptionDetails'].get('exception', {}).get('description')}")
        return result.get("result", {}).get("value")

    def click(self, selector: str) -> None:
        """Click the middle of the first element matching `selector` with the mouse, as a user does."""
        box = self.evaluate(
            f"(() => {{ const e = document.querySelector({json.dumps(selector)}); if (!e) return null;"
            " e.scrollIntoView({block: 'center'}); const r = e.getBoundingClientRect();"
            " return [r.left + r.width / 2, r.top + r.height / 2]; })()")
        if box is None:
            raise BrowserError(f"nothing matches {selector}")
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", type=kind, x=box[0], y=box[1], button="left", clickCount=1)

    def screenshot(self, path: Path, full_page: bool = True) -> Path:
        """Write a PNG of the page (all of it with `full_page`) to `path`."""
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            width, height = self.evaluate("[document.documentElement.scrollWidth, document.documentElement.scrollHeight]")
            params.update(captureBeyondViewport=True, clip={"x": 0, "y": 0, "width": width, "height": height, "scale": 1})
        data = base64.b64decode(self.send("Page.captureScreenshot", **params)["data"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return path
