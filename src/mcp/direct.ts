// run_command in the server reaches the exec service directly instead of re-entering Fastify through app.inject,
// which cost about one more REST request of CPU on every tool call. What the exec route gave is kept, explicitly:
// - who: the key POST /v1/mcp was authenticated with. The auth hook checked it and tracks that request, so a
//   revocation cuts it as it would the exec request; the exec route asks nothing beyond a valid key.
// - what: the exec route's own schemas (its `:id` and its body), refused as invalid_request like the route does.
// - where: a machine another host runs is not served here: the call goes through the API, which forwards it.
// - errors: Kiln's code and message with this request's id; anything else is `internal`, never its own message.
// - metrics: the exec latency histogram observes the call as it observed the injected request.
// Tools whose route checks more than the key (an operator-only option, a placement) keep calling the API.

import { Compile } from "typebox/compile";
import type { FastifyBaseLogger } from "fastify";
import { KilnError, toEnvelope } from "../errors.ts";
import type { ErrorCode } from "../errors.ts";
import type { ExecInput, ExecService } from "../machines/exec.ts";
import { ExecRequest, Params } from "../api/routes/machines.ts";
import { callJson } from "./caller.ts";
import type { KilnCaller } from "./caller.ts";

export type ExecAnswer = Awaited<ReturnType<ExecService["exec"]>>;

/** The calls a tool may make without the HTTP API; each answers what the route would have. */
export interface DirectCalls {
  exec(machineId: string, input: ExecInput): Promise<ExecAnswer>;
}

/** What the server gives MCP for direct calls. */
export interface DirectDeps {
  exec: ExecService;
  /** True when the machine runs on another host of the store (the API forwards it there); absent without hosts. */
  elsewhere?: (machineId: string) => Promise<boolean>;
  /** Observes a call as a request of that route (metrics). */
  observe?: (method: string, route: string, status: number, seconds: number) => void;
}

const EXEC_ROUTE = "/v1/machines/:id/exec";
const checkParams = Compile(Params);
const checkBody = Compile(ExecRequest);

/** Fastify's words for a schema refusal (`body/cmd must …`), from TypeBox's first error. */
function refusal(part: "params" | "body", errors: { instancePath: string; message: string }[]): KilnError {
  const first = errors[0];
  const where = first ? `${part}${first.instancePath}` : part;
  return new KilnError("invalid_request", `${where} ${first?.message ?? "is not valid"}`);
}

export function directCalls(deps: DirectDeps, ctx: { call: KilnCaller; requestId: string; log: FastifyBaseLogger }): DirectCalls {
  return {
    async exec(machineId, input) {
      if (deps.elsewhere && (await deps.elsewhere(machineId))) {
        return callJson<ExecAnswer>(ctx.call, "POST", `/v1/machines/${encodeURIComponent(machineId)}/exec`, { json: input });
      }
      const started = performance.now();
      let status = 200;
      try {
        if (!checkParams.Check({ id: machineId })) throw refusal("params", checkParams.Errors({ id: machineId }));
        if (!checkBody.Check(input)) throw refusal("body", checkBody.Errors(input));
        return await deps.exec.exec(machineId, input);
      } catch (err) {
        const { status: s, body } = toEnvelope(err, ctx.requestId);
        status = s;
        if (status >= 500 && body.code !== "unavailable") ctx.log.error({ err }, "run_command failed");
        throw new KilnError(body.code as ErrorCode, body.error, { detail: { ...body.error_detail, request_id: ctx.requestId }, cause: err });
      } finally {
        deps.observe?.("POST", EXEC_ROUTE, status, (performance.now() - started) / 1000);
      }
    },
  };
}
