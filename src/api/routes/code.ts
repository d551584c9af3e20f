// The code interpreter (tag Code): contexts (kernels) of a machine and executes streamed as NDJSON frames.
// SPEC.md's DELETE …/code/contexts/{ctx_id} answers 204; an unknown or already removed context is a 404 envelope.

import { Type } from "typebox";
import type { App } from "../app-type.ts";
import type { Services } from "../../services/index.ts";
import { CODE_DEFAULT_LANGUAGE, CODE_DEFAULT_TIMEOUT_S, CODE_FRAME_TYPES, CODE_LANGUAGES } from "../../code/service.ts";
import { errors, Id, MachinePath } from "../schemas.ts";
import { abortOnClientGone } from "./client-gone.ts";

const Params = Type.Object({ id: Id });
const CtxParams = Type.Object({ id: Id, ctx_id: Id });
const Language = Type.Enum(CODE_LANGUAGES);

const CodeContext = Type.Object({ id: Type.String(), language: Language, cwd: Type.String() });

const ExecuteRequest = Type.Object(
  {
    code: Type.String({ maxLength: 4 * 1024 * 1024 }),
    context_id: Type.Optional(Id),
    language: Type.Optional({ ...Language, description: `Without context_id: the default context of this language (default ${CODE_DEFAULT_LANGUAGE}), made on first use` }),
    timeout_s: Type.Optional(Type.Integer({ minimum: 1, maximum: 3600, description: `Interrupts the execution past it; default ${CODE_DEFAULT_TIMEOUT_S}` })),
  },
  { additionalProperties: false },
);

export async function codeRoutes(app: App, opts: { services: Services }) {
  const { code } = opts.services;
  const tags = ["Code"];

  app.post(
    "/v1/machines/:id/code/contexts",
    {
      config: { auth: "key" },
      schema: {
        tags,
        summary: "Start a kernel context (python: ipykernel; javascript: a Node kernel)",
        params: Params,
        body: Type.Object({ language: Type.Optional({ ...Language, default: CODE_DEFAULT_LANGUAGE }), cwd: Type.Optional(MachinePath) }, { additionalProperties: false }),
        response: { 201: CodeContext, ...errors(400, 404, 409, 504) },
      },
    },
    async (req, reply) => reply.code(201).send(await code.create(req.params.id, req.body)),
  );

  app.get(
    "/v1/machines/:id/code/contexts",
    { config: { auth: "key" }, schema: { tags, summary: "List the machine's kernel contexts", params: Params, response: { 200: Type.Object({ contexts: Type.Array(CodeContext) }), ...errors(404, 409) } } },
    async (req) => code.list(req.params.id),
  );

  app.post(
    "/v1/machines/:id/code/contexts/:ctx_id/restart",
    { config: { auth: "key" }, schema: { tags, summary: "Restart a context's kernel (its state is lost)", params: CtxParams, response: { 200: CodeContext, ...errors(404, 409) } } },
    async (req) => code.restart(req.params.id, req.params.ctx_id),
  );

  app.delete(
    "/v1/machines/:id/code/contexts/:ctx_id",
    { config: { auth: "key" }, schema: { tags, summary: "Remove a kernel context; its kernel process is stopped", params: CtxParams, response: { 204: Type.Null(), ...errors(404, 409) } } },
    async (req, reply) => {
      await code.remove(req.params.id, req.params.ctx_id);
      return reply.code(204).send(null);
    },
  );

  app.post(
    "/v1/machines/:id/code/execute",
    {
      config: { auth: "key" },
      schema: {
        tags,
        summary: `Run code in a context; answers application/x-ndjson frames {type: ${CODE_FRAME_TYPES.join("|")}}, the last one end`,
        params: Params,
        body: ExecuteRequest,
        response: { ...errors(400, 404, 409) },
      },
    },
    async (req, reply) => {
      const stream = await code.execute(req.params.id, req.body, abortOnClientGone(reply));
      return reply.type("application/x-ndjson").header("cache-control", "no-store").send(stream);
    },
  );
}
