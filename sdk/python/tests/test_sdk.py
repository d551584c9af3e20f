"""The Python SDK against a real Kiln server (KILN_URL, KILN_API_KEY), run by test/sdk/python.test.ts with
Debian's /usr/bin/python3: machines, exec, files, code, a build with its log streamed, webhook verification."""

import base64
import http.server
import json
import os
import secrets
import sys
import threading
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kiln import Client, KilnError, webhooks  # noqa: E402


class Receiver:
    """A real webhook receiver on loopback that keeps every request it gets."""

    def __init__(self):
        self.requests = []
        self.arrived = threading.Condition()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                with outer.arrived:
                    outer.requests.append((dict(self.headers.items()), body))
                    outer.arrived.notify_all()
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = "http://127.0.0.1:%d/hook" % self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait(self, count, timeout=30):
        deadline = time.monotonic() + timeout
        with self.arrived:
            while len(self.requests) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError("the receiver got %d of %d deliveries" % (len(self.requests), count))
                self.arrived.wait(left)
        return self.requests[:count]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


class SdkTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.kiln = Client()
        cls.machine = cls.kiln.machines.create(timeout_s=600, name="python-sdk")

    @classmethod
    def tearDownClass(cls):
        cls.kiln.machines.destroy(cls.machine["id"])

    def test_a_wrong_key_is_refused_with_the_envelope(self):
        with self.assertRaises(KilnError) as caught:
            Client(api_key="kiln_wrong_0123456789abcdefghijklmnopq").machines.get(self.machine["id"])
        self.assertEqual(caught.exception.code, "unauthorized")
        self.assertEqual(caught.exception.status, 401)
        self.assertTrue(caught.exception.request_id.startswith("req_"))
        self.assertNotIn(self.kiln.api_key, repr(self.kiln))

    def test_machines_are_listed_and_a_missing_one_is_not_found(self):
        self.assertIn(self.machine["id"], [m["id"] for m in self.kiln.machines.list()])
        self.assertEqual(self.kiln.machines.get(self.machine["id"])["status"], "running")
        with self.assertRaises(KilnError) as caught:
            self.kiln.machines.get("mch_doesnotexist")
        self.assertEqual((caught.exception.code, caught.exception.status), ("not_found", 404))

    def test_exec_answers_stdout_stderr_and_the_exit_code(self):
        r = self.kiln.machines.exec(self.machine["id"], "echo out; echo err >&2; exit 3")
        self.assertEqual((r["stdout"], r["stderr"], r["exit_code"]), ("out\n", "err\n", 3))
        r = self.kiln.machines.exec(self.machine["id"], "printf", args=["%s|", "a b", "$HOME"])
        self.assertEqual(r["stdout"], "a b|$HOME|")

    def test_files_are_written_read_listed_and_described(self):
        data = bytes(range(256)) * 40
        meta = self.kiln.machines.write_file(self.machine["id"], "/workspace/sdk/blob.bin", data, mode="0640")
        self.assertEqual(meta["size"], len(data))
        self.assertEqual(self.kiln.machines.read_file(self.machine["id"], "/workspace/sdk/blob.bin"), data)
        names = [e["name"] for e in self.kiln.machines.list_files(self.machine["id"], "/workspace/sdk")]
        self.assertEqual(names, ["blob.bin"])
        info = self.kiln.machines.file_info(self.machine["id"], "sdk/blob.bin")
        self.assertEqual((info["path"], info["permissions"], info["type"]), ("/workspace/sdk/blob.bin", "0640", "file"))

    def test_code_keeps_state_in_its_kernel_and_returns_rich_results(self):
        ctx = self.kiln.machines.create_context(self.machine["id"], "python")
        self.kiln.machines.run_code(self.machine["id"], "x = 6", context_id=ctx["id"])
        out = self.kiln.machines.run_code(self.machine["id"], "print('x is', x)\nx * 7", context_id=ctx["id"])
        self.assertEqual(out["stdout"], "x is 6\n")
        self.assertEqual(out["results"][0]["text/plain"], "42")
        self.assertIsNone(out["error"])
        failed = self.kiln.machines.run_code(self.machine["id"], "1/0", context_id=ctx["id"])
        self.assertEqual(failed["error"]["name"], "ZeroDivisionError")

    def test_a_build_streams_its_log_and_its_history_keeps_it(self):
        marker = secrets.token_hex(4)
        entries = []
        end = self.kiln.templates.build_and_wait(
            {"name": "py-sdk-" + marker, "steps": [{"type": "run", "command": "echo built-%s" % marker}]},
            on_entry=entries.append,
        )
        self.assertEqual(entries[0]["kind"], "start")
        self.assertTrue(any(("built-" + marker) in e["message"] for e in entries if e["kind"] == "message"))
        self.assertTrue(end["metadata"]["artifact_id"].startswith("art_"))
        history = list(self.kiln.templates.builds(end["template_id"]))
        self.assertEqual([b["status"] for b in history], ["ready"])
        # The log replays after a given entry, as a resuming client reads it.
        replay = [entry for _, entry in self.kiln.templates.logs(end["template_id"], end["build_id"], last_event_id=1)]
        self.assertEqual(len(replay), len(entries) - 1)
        self.assertEqual(replay[-1]["kind"], "end")
        with self.assertRaises(KilnError) as caught:
            self.kiln.templates.build_and_wait({"name": "py-sdk-fail-" + marker, "steps": [{"type": "run", "command": "exit 7"}]})
        self.assertEqual(caught.exception.code, "build_error")

    def test_webhook_deliveries_verify_with_the_signing_secret(self):
        receiver = Receiver()
        self.addCleanup(receiver.close)
        secret = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
        # A loopback receiver: the operator's key lets this one webhook reach it (the server allows no private ones).
        hook = self.kiln.webhooks.create(receiver.url, ["create"], secret, allow_private=True)
        self.assertTrue(hook["allow_private"])
        self.addCleanup(self.kiln.webhooks.delete, hook["id"])
        m = self.kiln.machines.create(timeout_s=120)
        self.addCleanup(self.kiln.machines.destroy, m["id"])
        headers, body = receiver.wait(1)[0]
        event_id = webhooks.verify(secret, headers, body)
        payload = json.loads(body)
        self.assertEqual((payload["id"], payload["operation"], payload["machine"]["id"]), (event_id, "create", m["id"]))
        with self.assertRaises(KilnError):
            webhooks.verify(secret, headers, body + b" ")
        with self.assertRaises(KilnError):
            webhooks.verify("whsec_" + base64.b64encode(secrets.token_bytes(32)).decode(), headers, body)
        with self.assertRaises(KilnError):
            webhooks.verify(secret, headers, body, now=time.time() + 3600)
        # The receiver answered; the server records the attempt just after.
        deadline = time.monotonic() + 30
        while list(self.kiln.webhooks.deliveries(hook["id"]))[0]["status"] != "succeeded" and time.monotonic() < deadline:
            time.sleep(0.1)
        delivered = list(self.kiln.webhooks.deliveries(hook["id"], status="succeeded"))[0]
        self.assertEqual(delivered["event_id"], event_id)
        # A replay sends the same event again as a new delivery, which the receiver verifies as before.
        again = self.kiln.webhooks.replay(hook["id"], delivered["id"])
        self.assertNotEqual(again["id"], delivered["id"])
        self.assertEqual(again["event_id"], event_id)
        headers, body = receiver.wait(2)[1]
        self.assertEqual(webhooks.verify(secret, headers, body), event_id)


if __name__ == "__main__":
    unittest.main()
