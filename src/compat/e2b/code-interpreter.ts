// E2B's code-interpreter server (what `@e2b/code-interpreter` reaches at port 49999 of a sandbox), answered by
// Kiln's own code service (src/code/: kernels held by the guest agent): /execute streams E2B's NDJSON, /contexts
// creates, lists, restarts and deletes contexts, /health answers while the sandbox runs.
// Requests carry `E2b-Sandbox-Id` with `E2b-Sandbox-Port: 49999`, or a `49999-<id>.` Host.

import { stripTypeScriptTypes } from "node:module";
import { PassThrough } from "node:stream";
import type { Readable } from "node:stream";
import { createInterface } from "node:readline";
import { Type } from "typebox";
import type { Static } from "typebox";
import type { FastifyInstance, FastifyReply, FastifyRequest } from "fastify";
import type { Services } from "../../services/index.ts";
import type { CodeFrame, CodeLanguage } from "../../agent/protocol.ts";
import { KilnError } from "../../errors.ts";
import { e2bError } from "./errors.ts";
import { sandboxIdOf as e2bIdOf } from "./ids.ts";

export const JUPYTER_PORT = 49999;

/** How long one E2B execute may run in the machine: the SDK bounds it itself (timeoutMs, 60 s by default). */
export const E2B_EXECUTE_BOUND_S = 3600;
const KEEPALIVE_MS = 15_000;

// E2B's language names; `ts` runs on the JavaScript kernel once its types are stripped (Node's own stripper).
const LANGUAGES: Record<string, { kernel: CodeLanguage; typescript: boolean }> = {
  python: { kernel: "python", typescript: false },
  js: { kernel: "javascript", typescript: false },
  javascript: { kernel: "javascript", typescript: false },
  ts: { kernel: "javascript", typescript: true },
  typescript: { kernel: "javascript", typescript: true },
};

function languageOf(name: string | undefined) {
  const lang = LANGUAGES[(name ?? "python").toLowerCase()];
  if (!lang) throw new KilnError("invalid_request", `Unsupported language ${JSON.stringify(name)}: Kiln runs python, js/javascript and ts`);
  return lang;
}

// Kernel MIME types as the fields of E2B's result frame; any other type goes under `extra`.
const MIME_FIELDS: Record<string, string> = {
  "text/plain": "text",
  "text/html": "html",
  "text/markdown": "markdown",
  "image/svg+xml": "svg",
  "image/png": "png",
  "image/jpeg": "jpeg",
  "application/pdf": "pdf",
  "text/latex": "latex",
  "application/json": "json",
  "application/javascript": "javascript",
};

/** A Kiln result frame as E2B's (JSON-valued types back to values: the agent sends every MIME value as a string). */
export function resultFrame(f: Extract<CodeFrame, { type: "result" }>) {
  const out: Record<string, unknown> = { type: "result", is_main_result: f.is_main_result };
  const extra: Record<string, unknown> = {};
  for (const [mime, value] of Object.entries(f.data)) {
    const field = MIME_FIELDS[mime];
    const parsed = mime.endsWith("json") ? parseJson(value) : value;
    if (field) out[field] = parsed;
    else extra[mime] = parsed;
  }
  if (Object.keys(extra).length > 0) out.extra = extra;
  return out;
}

function parseJson(value: string): unknown {
  try {
    return JSON.parse(value);
  } catch {
    return value;
  }
}

// additionalProperties: false, or a name the pattern refuses would pass the record untested (src/code/service.ts
// checks the names and the total again, as the guest agent takes them).
const EnvVars = Type.Record(Type.String({ pattern: "^[A-Za-z_][A-Za-z0-9_]*$", maxLength: 256 }), Type.String({ maxLength: 32 * 1024 }), { maxProperties: 256, additionalProperties: false });
const ExecuteBody = Type.Object(
  {
    code: Type.String({ maxLength: 1024 * 1024 }),
    context_id: Type.Optional(Type.Union([Type.String({ minLength: 1, maxLength: 64 }), Type.Null()])),
    language: Type.Optional(Type.Union([Type.String({ maxLength: 32 }), Type.Null()])),
    env_vars: Type.Optional(Type.Union([EnvVars, Type.Null()])),
  },
  { additionalProperties: false },
);
const ContextBody = Type.Union([
  Type.Object({ language: Type.Optional(Type.Union([Type.String({ maxLength: 32 }), Type.Null()])), cwd: Type.Optional(Type.Union([Type.String({ maxLength: 4096 }), Type.Null()])) }, { additionalProperties: false }),
  Type.Null(),
]);
const CtxParams = Type.Object({ ctx: Type.String({ minLength: 1, maxLength: 64 }) });

/** A sandbox that is paused, gone or unknown: 502, as E2B's proxy answers (the SDK's TimeoutError). */
class SandboxNotRunning extends Error {}

export interface CodeInterpreterDeps {
  services: Services;
  sandboxIdOf: (req: FastifyRequest) => string;
}

export async function codeInterpreterRoutes(parent: FastifyInstance, deps: CodeInterpreterDeps) {
  const { services } = deps;
  const config = { e2b: "jupyter", auth: "envd-token" as const };
  const constraints = { e2bEnvd: "jupyter" };
  // Contexts made as TypeScript (their kernel is JavaScript's): held here, so a Kiln restart forgets it (docs/e2b.md).
  const typescriptContexts = new Set<string>();

  /** The sandbox must be running: E2B's proxy answers 502 (the SDK's TimeoutError) for a paused or gone one. */
  async function runningSandbox(req: FastifyRequest): Promise<string> {
    const id = deps.sandboxIdOf(req);
    const m = await services.machines.get(id).catch(() => undefined);
    if (m?.status !== "running") throw new SandboxNotRunning(`The sandbox ${e2bIdOf(id)} is not running`);
    return id;
  }

  const view = (c: { id: string; language: CodeLanguage; cwd: string }) => ({ id: c.id, language: typescriptContexts.has(c.id) ? "ts" : c.language, cwd: c.cwd });

  // The SDK sends `Content-Type: application/json` with no body on restart and delete: in this scope an empty JSON
  // body is no body (Kiln's own routes keep refusing one).
  await parent.register(async (app) => {
    app.removeContentTypeParser("application/json");
    const json = app.getDefaultJsonParser("error", "error");
    app.addContentTypeParser("application/json", { parseAs: "string" }, (req, body, done) => (body === "" ? done(null, undefined) : json(req, body as string, done)));

    app.get("/health", { config, constraints, schema: { hide: true } }, async (req, reply) => {
      await runningSandbox(req);
      return reply.code(200).type("text/plain").send("OK");
    });

    app.post("/contexts", { config, constraints, schema: { hide: true, body: ContextBody } }, async (req) => {
      const id = await runningSandbox(req);
      const body = (req.body ?? {}) as Exclude<Static<typeof ContextBody>, null>;
      const lang = languageOf(body.language ?? undefined);
      const ctx = await services.code.create(id, { language: lang.kernel, cwd: body.cwd ?? undefined });
      if (lang.typescript) {
        if (typescriptContexts.size >= 100_000) typescriptContexts.clear();
        typescriptContexts.add(ctx.id);
      }
      return view(ctx);
    });

    app.get("/contexts", { config, constraints, schema: { hide: true } }, async (req) => {
      const id = await runningSandbox(req);
      return (await services.code.list(id)).contexts.map(view);
    });

    app.post("/contexts/:ctx/restart", { config, constraints, schema: { hide: true, params: CtxParams } }, async (req) => {
      const id = await runningSandbox(req);
      return view(await services.code.restart(id, (req.params as Static<typeof CtxParams>).ctx));
    });

    app.delete("/contexts/:ctx", { config, constraints, schema: { hide: true, params: CtxParams } }, async (req, reply) => {
      const id = await runningSandbox(req);
      const ctx = (req.params as Static<typeof CtxParams>).ctx;
      await services.code.remove(id, ctx);
      typescriptContexts.delete(ctx);
      return reply.code(204).send();
    });

    app.post("/execute", { config, constraints, schema: { hide: true, body: ExecuteBody } }, async (req, reply) => {
      const id = await runningSandbox(req);
      const body = req.body as Static<typeof ExecuteBody>;
      const contextId = body.context_id ?? undefined;
      if (contextId !== undefined && body.language) throw new KilnError("invalid_request", "You can provide context_id or language, but not both at the same time.");
      const lang = contextId === undefined ? languageOf(body.language ?? undefined) : { kernel: undefined, typescript: typescriptContexts.has(contextId) };
      let code = body.code;
      if (lang.typescript) {
        try {
          code = stripTypeScriptTypes(code);
        } catch (err) {
          throw new KilnError("invalid_request", `The TypeScript could not be read: ${(err as Error).message}`);
        }
      }
      // E2B interrupts the execution when its client goes away: the agent request is aborted, the agent interrupts.
      const abort = new AbortController();
      reply.raw.once("close", () => {
        if (!reply.raw.writableFinished) abort.abort();
      });
      const frames = await services.code.execute(id, { code, context_id: contextId, language: lang.kernel, timeout_s: E2B_EXECUTE_BOUND_S, envs: body.env_vars ?? undefined }, abort.signal);
      return streamExecution(reply, frames, abort);
    });
  });

  // Errors of these routes in E2B's shape; a sandbox that is not running is 502, as E2B's proxy answers.
  return {
    errorOf(err: unknown) {
      if (err instanceof SandboxNotRunning || (err instanceof KilnError && err.code === "machine_not_running")) return { status: 502, body: { code: 502, message: err.message } };
      return e2bError(err);
    },
  };
}

/** Kiln's NDJSON frames as E2B's, line by line, keepalives between; `end` becomes number_of_executions + end_of_execution. */
function streamExecution(reply: FastifyReply, frames: Readable, abort: AbortController) {
  const out = new PassThrough();
  const lines = createInterface({ input: frames, crlfDelay: Infinity });
  // Paced by the client, as the native code/execute is: while the client has not taken what waits, the agent's
  // answer is not read (the agent then holds the kernel), so a client that does not read costs the server nothing.
  const send = (frame: Record<string, unknown>) => {
    if (!out.writableEnded && !out.write(JSON.stringify(frame) + "\n") && frame.type !== "keepalive") lines.pause();
  };
  out.on("drain", () => lines.resume());
  const keepalive = setInterval(() => send({ type: "keepalive" }), KEEPALIVE_MS);
  // Node sends the response's headers with its first bytes: one keepalive now, so the client has its headers at
  // once — the SDK's timeoutMs clock starts with them — however long the code stays silent.
  send({ type: "keepalive" });
  const finish = () => {
    clearInterval(keepalive);
    if (!out.writableEnded) out.end();
  };
  lines.on("line", (line) => {
    let f: CodeFrame;
    try {
      f = JSON.parse(line) as CodeFrame;
    } catch {
      return;
    }
    const timestamp = Date.now() * 1000;
    switch (f.type) {
      case "stdout":
      case "stderr":
        return send({ type: f.type, text: f.text, timestamp });
      case "result":
        return send(resultFrame(f));
      case "error":
        return send({ type: "error", name: f.name, value: f.value, traceback: f.traceback });
      case "end":
        if (f.execution_count !== null) send({ type: "number_of_executions", execution_count: f.execution_count });
        send({ type: "end_of_execution" });
        return finish();
    }
  });
  lines.on("close", finish);
  // The agent's answer broke off (the machine stopped, or the client left and the call was aborted): the client's
  // stream ends without end_of_execution. readline passes its input's error on, so both are listened to.
  const broken = () => {
    clearInterval(keepalive);
    out.destroy();
  };
  frames.on("error", broken);
  lines.on("error", broken);
  out.on("close", () => {
    clearInterval(keepalive);
    // The client left before the end: the agent call is aborted, which interrupts the execution.
    if (!out.writableFinished) abort.abort();
    if (!frames.destroyed) frames.destroy();
  });
  return reply.code(200).type("application/x-ndjson").header("cache-control", "no-cache").send(out);
}
