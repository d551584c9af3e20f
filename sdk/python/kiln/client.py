"""A small client for Kiln's HTTP API: machines, exec, files, code, template builds (with streamed logs) and
lifecycle webhooks. Standard library only; JSON in and out, the API key in the Authorization header."""

import json
import os
import socket
import time
import urllib.error
import urllib.parse
import urllib.request

from .errors import KilnError
from .sse import read_events

TERMINAL_KINDS = ("end", "error", "cancelled")


def _q(params):
    params = {k: ("true" if v is True else "false" if v is False else v) for k, v in params.items() if v is not None}
    return ("?" + urllib.parse.urlencode(params)) if params else ""


def _p(value):
    return urllib.parse.quote(str(value), safe="")


class Client:
    """``Client()`` reads ``KILN_URL`` (default ``http://127.0.0.1:8080``) and ``KILN_API_KEY``."""

    def __init__(self, base_url=None, api_key=None, timeout=60.0):
        self.base_url = (base_url or os.environ.get("KILN_URL") or "http://127.0.0.1:8080").rstrip("/")
        self.api_key = api_key or os.environ.get("KILN_API_KEY")
        if not self.api_key:
            raise KilnError("no API key: pass api_key or set KILN_API_KEY", "unauthorized")
        self.timeout = timeout
        self.machines = Machines(self)
        self.templates = Templates(self)
        self.webhooks = Webhooks(self)

    def __repr__(self):
        # Never the key.
        return "Client(%r)" % self.base_url

    def open(self, method, path, body=None, raw=None, headers=None, timeout=None):
        """Sends a request and answers the open response (the caller reads and closes it); refusals raise KilnError."""
        h = {"authorization": "Bearer " + self.api_key, "accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode("utf-8")
            h["content-type"] = "application/json"
        elif raw is not None:
            data = raw if isinstance(raw, bytes) else raw.encode("utf-8")
            h["content-type"] = "application/octet-stream"
        h.update(headers or {})
        req = urllib.request.Request(self.base_url + path, data=data, method=method, headers=h)
        try:
            return urllib.request.urlopen(req, timeout=timeout or self.timeout)
        except urllib.error.HTTPError as err:
            raise _envelope(err) from None
        except (urllib.error.URLError, socket.timeout) as err:
            raise KilnError("cannot reach Kiln at %s: %s" % (self.base_url, getattr(err, "reason", err)), "unreachable") from None

    def call(self, method, path, body=None, raw=None, timeout=None):
        """One JSON request and its JSON answer (None for an empty body)."""
        with self.open(method, path, body=body, raw=raw, timeout=timeout) as res:
            text = res.read()
        return json.loads(text) if text else None

    def pages(self, route, field, query=None):
        """Every item of a cursor-paged list, page by page."""
        cursor = None
        while True:
            page = self.call("GET", route + _q(dict(query or {}, limit=100, cursor=cursor)))
            for item in page[field]:
                yield item
            cursor = page.get("next_cursor")
            if not cursor:
                return

    def sse(self, method, path, body=None, last_event_id=None):
        """Yields ``(id, entry)`` for each event of an SSE answer."""
        headers = {"accept": "text/event-stream"}
        if last_event_id is not None:
            headers["last-event-id"] = str(last_event_id)
        with self.open(method, path, body=body, headers=headers) as res:
            for event_id, _event, data in read_events(res):
                yield event_id, json.loads(data)


def _envelope(err):
    try:
        body = json.loads(err.read() or b"{}")
    except ValueError:
        body = {}
    return KilnError(body.get("error") or "HTTP %d" % err.code, body.get("code") or "http_error", err.code, body.get("request_id"), body.get("error_detail"))


class Machines:
    def __init__(self, client):
        self._c = client

    def create(self, template=None, **fields):
        """``POST /v1/machines``; fields as the API takes them (timeout_s, name, envs, memory_mb, volumes…)."""
        body = dict(fields)
        if template is not None:
            body["template"] = template
        return self._c.call("POST", "/v1/machines", body)

    def list(self, status=None):
        return self._c.pages("/v1/machines", "machines", {"status": status})

    def get(self, machine_id):
        return self._c.call("GET", "/v1/machines/" + _p(machine_id))

    def destroy(self, machine_id):
        return self._c.call("DELETE", "/v1/machines/" + _p(machine_id))

    def exec(self, machine_id, cmd, args=None, timeout_s=None, **fields):
        """Runs a command to its end: ``{exit_code, signal, stdout, stderr, duration_ms}``. Without ``args``,
        ``cmd`` is a shell line; with them, the program."""
        body = dict(fields, cmd=cmd)
        if args is not None:
            body["args"] = list(args)
        if timeout_s is not None:
            body["timeout_s"] = timeout_s
        # The HTTP wait outlasts the command's own bound.
        return self._c.call("POST", "/v1/machines/%s/exec" % _p(machine_id), body, timeout=(timeout_s or 60) + 30)

    def read_file(self, machine_id, path, user=None):
        with self._c.open("GET", "/v1/machines/%s/files%s" % (_p(machine_id), _q({"path": path, "user": user}))) as res:
            return res.read()

    def write_file(self, machine_id, path, data, mode=None, user=None):
        return self._c.call("PUT", "/v1/machines/%s/files%s" % (_p(machine_id), _q({"path": path, "mode": mode, "user": user})), raw=data)

    def list_files(self, machine_id, path, depth=1):
        return list(self._c.pages("/v1/machines/%s/files/list" % _p(machine_id), "entries", {"path": path, "depth": depth}))

    def file_info(self, machine_id, path, user=None):
        body = {"path": path}
        if user is not None:
            body["user"] = user
        return self._c.call("POST", "/v1/machines/%s/files/info" % _p(machine_id), body)

    def run_code(self, machine_id, code, language=None, context_id=None, timeout_s=None):
        """Runs code in a kernel (Python by default; state persists per context) and answers
        ``{stdout, stderr, results, error, end}``: ``results`` are MIME bundles (``text/plain``, ``image/png``…)."""
        body = {"code": code}
        for k, v in (("language", language), ("context_id", context_id), ("timeout_s", timeout_s)):
            if v is not None:
                body[k] = v
        out = {"stdout": "", "stderr": "", "results": [], "error": None, "end": None}
        with self._c.open("POST", "/v1/machines/%s/code/execute" % _p(machine_id), body=body, timeout=(timeout_s or 300) + 30) as res:
            for line in res:
                if not line.strip():
                    continue
                frame = json.loads(line)
                kind = frame.get("type")
                if kind in ("stdout", "stderr"):
                    out[kind] += frame.get("text", "")
                elif kind == "result":
                    out["results"].append(frame.get("data", {}))
                elif kind == "error":
                    out["error"] = frame
                elif kind == "end":
                    out["end"] = frame
        return out

    def create_context(self, machine_id, language="python", cwd=None):
        body = {"language": language}
        if cwd is not None:
            body["cwd"] = cwd
        return self._c.call("POST", "/v1/machines/%s/code/contexts" % _p(machine_id), body)


class Templates:
    def __init__(self, client):
        self._c = client

    def list(self):
        return self._c.call("GET", "/v1/templates")["templates"]

    def builds(self, template_id, **filters):
        """Build history, newest first; filters: status, build_backend, source_type."""
        return self._c.pages("/v1/templates/%s/builds" % _p(template_id), "builds", filters)

    def build(self, request, resumes=5):
        """Starts a build and yields its log entries as they come, ending with ``end``, ``error`` or ``cancelled``.
        A dropped connection is resumed from the last entry seen (the build's log route, Last-Event-ID)."""
        last_id, build = None, None
        stream = self._c.sse("POST", "/v1/templates/build", body=request)
        while True:
            try:
                for event_id, entry in stream:
                    last_id = event_id or last_id
                    build = build or (entry.get("template_id"), entry.get("build_id"))
                    yield entry
                    if entry.get("kind") in TERMINAL_KINDS:
                        stream.close()
                        return
            except (OSError, ValueError) as err:
                if build is None or resumes <= 0:
                    raise KilnError("the build stream broke: %s" % err, "stream_error") from None
            if build is None or resumes <= 0:
                raise KilnError("the build stream ended before its last entry", "stream_error")
            resumes -= 1
            time.sleep(0.5)
            stream = self.logs(build[0], build[1], last_event_id=last_id)

    def logs(self, template_id, build_id, last_event_id=None):
        """A build's log, replayed from after ``last_event_id`` and followed while the build runs: ``(id, entry)``."""
        return self._c.sse("GET", "/v1/templates/%s/builds/%s/logs" % (_p(template_id), _p(build_id)), last_event_id=last_event_id)

    def build_and_wait(self, request, on_entry=None):
        """Builds and answers the final ``end`` entry (its ``metadata.artifact_id``); a failed build raises
        KilnError with ``code`` ``build_error`` (or ``cancelled``)."""
        for entry in self.build(request):
            if on_entry:
                on_entry(entry)
            kind = entry.get("kind")
            if kind == "end":
                return entry
            if kind in ("error", "cancelled"):
                detail = entry.get("error_detail") or {}
                raise KilnError(entry.get("message", kind), detail.get("code", kind), 0, None, detail)
        raise KilnError("the build stream ended without a terminal entry", "stream_error")


class Webhooks:
    def __init__(self, client):
        self._c = client

    def create(self, url, operations=None, signing_secret=None, allow_private=None):
        """Registers a receiver. Without a signing secret Kiln makes one (in the answer, shown only this once);
        allow_private (the operator's key only) lets it reach private and loopback receivers."""
        body = {"url": url}
        if operations is not None:
            body["operations"] = list(operations)
        if signing_secret is not None:
            body["signing_secret"] = signing_secret
        if allow_private is not None:
            body["allow_private"] = allow_private
        return self._c.call("POST", "/v1/lifecycle/webhooks", body)

    def list(self):
        return self._c.pages("/v1/lifecycle/webhooks", "webhooks")

    def update(self, webhook_id, **fields):
        return self._c.call("PATCH", "/v1/lifecycle/webhooks/" + _p(webhook_id), fields)

    def delete(self, webhook_id):
        return self._c.call("DELETE", "/v1/lifecycle/webhooks/" + _p(webhook_id))

    def deliveries(self, webhook_id, status=None):
        return self._c.pages("/v1/lifecycle/webhooks/%s/deliveries" % _p(webhook_id), "deliveries", {"status": status})

    def retry(self, webhook_id, delivery_id):
        return self._c.call("POST", "/v1/lifecycle/webhooks/%s/deliveries/%s/retry" % (_p(webhook_id), _p(delivery_id)))

    def replay(self, webhook_id, delivery_id):
        """Sends a delivered event again as a new delivery (same event id, so receivers can tell)."""
        return self._c.call("POST", "/v1/lifecycle/webhooks/%s/deliveries/%s/replay" % (_p(webhook_id), _p(delivery_id)))
