// A client that does not keep up, for the flood tests (a kernel's or a process's output against a reader that reads
// nothing for a while): a request whose response is handed back unread, and the reading on that follows.

import { request } from "node:http";
import type { IncomingMessage, OutgoingHttpHeaders } from "node:http";

/** POSTs `body` to `url` and hands back the response unread (paused). */
export function startUnread(url: URL, headers: OutgoingHttpHeaders, body: Buffer | string): Promise<IncomingMessage> {
  return new Promise((resolve, reject) => {
    const req = request(url, { method: "POST", headers }, (res) => {
      res.pause();
      resolve(res);
    });
    req.once("error", reject);
    req.end(body);
  });
}

/** Reads on from a response handed back unread until more than `limit` bytes came or it ended, then hangs up;
 *  hands back what was read. */
export async function readOn(res: IncomingMessage, limit: number): Promise<Buffer> {
  res.resume();
  const chunks: Buffer[] = [];
  let got = 0;
  for await (const chunk of res) {
    chunks.push(chunk as Buffer);
    got += (chunk as Buffer).length;
    if (got > limit) break;
  }
  res.destroy();
  return Buffer.concat(chunks);
}
