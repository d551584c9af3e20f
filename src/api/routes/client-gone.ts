// An AbortSignal that fires when the client goes away before its answer is written, so work done on its behalf
// inside a machine (a git run, a kernel execute) is cancelled instead of running on for no one.

import type { FastifyReply } from "fastify";

export function abortOnClientGone(reply: FastifyReply): AbortSignal {
  const controller = new AbortController();
  reply.raw.once("close", () => {
    if (!reply.raw.writableFinished) controller.abort();
  });
  return controller.signal;
}
