"""A small proxy for trying disaggregated prefill through kvpool:
``python -m kvpool.disagg_proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200``.

Each completion request (``/v1/completions``, ``/v1/chat/completions``) goes first to the
prefill instance (vLLM with ``kv_role`` ``kv_producer``), asking for one token, not streamed;
then to the decode instance (``kv_consumer``) with the ``kv_transfer_params`` the prefill
instance answered (kvpool's hand-off: how much of the prompt its saves cover), and the decode
instance's answer goes back to the client as it comes (streamed when the client asked). Any
other request goes to the decode instance, and so does a completion of several prompts at once
(vLLM answers one ``kv_transfer_params`` for a batch), without a hand-off. If the prefill
instance fails, the request still goes to the decode instance, without a hand-off: it computes
the prompt itself. The client's ``Authorization`` header goes to both instances.

Standard library only, one thread per connection, a timeout on every upstream call. It is a
tool for trying the roles and for tests, not a production router (no load balancing over
several instances, no retries).
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

logger = logging.getLogger("kvpool.disagg_proxy")

#: The endpoints whose requests are prefilled first.
COMPLETIONS = ("/v1/completions", "/v1/chat/completions")


def prefill_body(body: dict) -> dict:
    """The request the prefill instance gets: the client's, generating one token, not
    streamed."""
    out = dict(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out.pop("min_tokens", None)  # vLLM refuses min_tokens above max_tokens
    return out


def is_batch(body: dict) -> bool:
    """Whether a completion request carries several prompts (a list of strings or of token
    id lists)."""
    prompt = body.get("prompt")
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))


def make_handler(prefill: str, decode: str, timeout_s: float):
    """The request handler class for upstreams ``prefill`` and ``decode`` (base URLs)."""

    class Handler(BaseHTTPRequestHandler):
        # HTTP/1.0: a relayed answer of unknown length ends when the connection closes.
        protocol_version = "HTTP/1.0"

        def log_message(self, fmt, *args):  # through logging, not stderr
            logger.debug("%s " + fmt, self.address_string(), *args)

        def _headers(self) -> dict[str, str]:
            headers = {"Content-Type": "application/json"}
            if self.headers.get("Authorization"):
                headers["Authorization"] = self.headers["Authorization"]
            return headers

        def _relay(self, url: str, data: bytes | None, method: str) -> None:
            request = urllib.request.Request(url, data=data, method=method,
                                             headers=self._headers())
            try:
                upstream = urllib.request.urlopen(request, timeout=timeout_s)
            except urllib.error.HTTPError as e:
                upstream = e
            except (OSError, http.client.HTTPException) as e:
                self.send_error(502, f"upstream {url}: {e}")
                return
            with upstream:
                self.send_response(upstream.status)
                kind = upstream.headers.get("Content-Type", "application/json")
                self.send_header("Content-Type", kind)
                self.end_headers()
                read = getattr(upstream, "read1", upstream.read)
                while chunk := read(65536):
                    self.wfile.write(chunk)
                    self.wfile.flush()

        def do_GET(self):  # noqa: N802 - http.server's name
            self._relay(decode + self.path, None, "GET")

        def do_POST(self):  # noqa: N802 - http.server's name
            raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.path not in COMPLETIONS:
                self._relay(decode + self.path, raw, "POST")
                return
            try:
                body = json.loads(raw)
            except ValueError:
                body = None
            if not isinstance(body, dict):
                self.send_error(400, "the request body is not a JSON object")
                return
            params = None if is_batch(body) else self._prefill(body)
            if params is not None:
                body["kv_transfer_params"] = params
            self._relay(decode + self.path, json.dumps(body).encode(), "POST")

        def _prefill(self, body: dict) -> dict | None:
            """The prefill instance's ``kv_transfer_params`` for ``body``, or ``None``."""
            request = urllib.request.Request(
                prefill + self.path, data=json.dumps(prefill_body(body)).encode(),
                method="POST", headers=self._headers())
            try:
                with urllib.request.urlopen(request, timeout=timeout_s) as answer:
                    reply = json.loads(answer.read())
                params = reply.get("kv_transfer_params") if isinstance(reply, dict) else None
            except (OSError, ValueError, http.client.HTTPException) as e:
                logger.warning("prefill at %s failed (%s); the decode instance computes the "
                               "prompt", prefill, e)
                return None
            return params if isinstance(params, dict) else None

    return Handler


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m kvpool.disagg_proxy",
        description="Prefill on one vLLM instance (kv_producer), decode on another "
                    "(kv_consumer), KV handed off through kvpool.")
    parser.add_argument("--prefill", required=True, help="the prefill instance's base URL")
    parser.add_argument("--decode", required=True, help="the decode instance's base URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds for each upstream call (default 600)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    handler = make_handler(args.prefill.rstrip("/"), args.decode.rstrip("/"), args.timeout)
    server = ThreadingHTTPServer((args.host, args.port), handler)
    logger.info("listening on %s:%d: prefill %s, decode %s", args.host, args.port,
                args.prefill, args.decode)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
