// The template build request (DESIGN.md §4's field names) as one TypeBox schema: the route's validator, the
// service's type and the OpenAPI entry. Unknown fields are rejected at every level.

import { Type } from "typebox";
import type { Static } from "typebox";
import { Step } from "./steps/index.ts";
import { BUILD_BACKENDS } from "./enums.ts";
import { SHA256_HEX } from "./context.ts";
import { EnvName, EnvValue, StepMode, StepUser } from "./steps/fields.ts";

const TemplateName = Type.String({ minLength: 1, maxLength: 128, pattern: "^(?:[a-z0-9][a-z0-9._-]*/)?[a-z0-9][a-z0-9._-]*$" });
const Tag = Type.String({ minLength: 1, maxLength: 128, pattern: "^[A-Za-z0-9][A-Za-z0-9._-]*$" });
const Envs = Type.Record(Type.String({ pattern: EnvName }), Type.String({ maxLength: 65536 }), { additionalProperties: false });
const NoNul = "^[^\\x00]*$";

export const BuildRequest = Type.Object(
  {
    name: Type.Optional(TemplateName),
    template_name: Type.Optional(TemplateName),
    alias: Type.Optional(Type.String({ minLength: 1, maxLength: 128, pattern: "^[a-z0-9][a-z0-9._-]*$" })),
    dockerfile: Type.Optional(Type.String({ minLength: 1, maxLength: 1024 * 1024 })),
    from_snapshot: Type.Optional(Type.String({ pattern: "^snp_[A-Za-z0-9]{1,64}$", description: "a snapshot (snp_…) of this host to build on: its machine's files, over its template" })),
    base_image: Type.Optional(Type.String({ minLength: 1, maxLength: 1024, pattern: "^[^\\s\\x00]+$" })),
    tags: Type.Optional(Type.Array(Tag, { minItems: 1, maxItems: 64, uniqueItems: true, description: "omitted means [\"default\"]; an explicit empty array is invalid" })),
    steps: Type.Optional(Type.Array(Step, { maxItems: 256 })),
    build_envs: Type.Optional(Envs),
    start_cmd: Type.Optional(Type.String({ minLength: 1, maxLength: 65536, pattern: NoNul })),
    ready_cmd: Type.Optional(Type.String({ minLength: 1, maxLength: 65536, pattern: NoNul })),
    context: Type.Optional(
      Type.Object(
        {
          files: Type.Array(
            Type.Object(
              { path: Type.String({ minLength: 1, maxLength: 4096, pattern: "^[^/\\x00-\\x1f][^\\x00-\\x1f]*$" }), sha256: Type.String({ pattern: SHA256_HEX }), mode: Type.Optional(StepMode) },
              { additionalProperties: false },
            ),
            { maxItems: 10_000 },
          ),
        },
        { additionalProperties: false },
      ),
    ),
    vm: Type.Optional(
      Type.Object(
        { vcpus: Type.Optional(Type.Integer({ minimum: 1, maximum: 64 })), memory_mb: Type.Optional(Type.Integer({ minimum: 128, maximum: 262_144 })), internet: Type.Optional(Type.Boolean()) },
        { additionalProperties: false },
      ),
    ),
    build_backend: Type.Optional(Type.Enum(BUILD_BACKENDS)),
    dockerfile_path: Type.Optional(Type.String({ minLength: 1, maxLength: 4096 })),
    build_args: Type.Optional(Type.Record(Type.String({ pattern: EnvName }), Type.String({ maxLength: 65536 }), { additionalProperties: false })),
    target: Type.Optional(Type.String({ minLength: 1, maxLength: 256 })),
    runtime_defaults: Type.Optional(
      Type.Object(
        { envs: Type.Optional(Type.Record(Type.String({ pattern: EnvName }), EnvValue, { additionalProperties: false })), cwd: Type.Optional(Type.String({ minLength: 1, maxLength: 4096, pattern: "^/[^\\x00-\\x1f]*$" })), user: Type.Optional(StepUser) },
        { additionalProperties: false },
      ),
    ),
    base_image_auth: Type.Optional(
      Type.Union([
        Type.Object({ type: Type.Literal("basic"), username: Type.String({ minLength: 1 }), password: Type.String({ minLength: 1 }) }, { additionalProperties: false }),
        Type.Object({ type: Type.Literal("token"), token: Type.String({ minLength: 1 }) }, { additionalProperties: false }),
        Type.Object({ type: Type.Literal("docker_config"), config: Type.String({ minLength: 1 }) }, { additionalProperties: false }),
      ]),
    ),
    registry_credentials: Type.Optional(
      Type.Array(Type.Object({ registry: Type.String({ minLength: 1 }), username: Type.String({ minLength: 1 }), password: Type.String({ minLength: 1 }) }, { additionalProperties: false }), { maxItems: 32 }),
    ),
    secrets: Type.Optional(Type.Array(Type.Object({ id: Type.String({ minLength: 1, maxLength: 256, pattern: "^[A-Za-z0-9_.-]+$" }), value: Type.String() }, { additionalProperties: false }), { maxItems: 64 })),
    skip_cache: Type.Optional(Type.Boolean()),
    name_claim_token: Type.Optional(Type.String({ minLength: 8, maxLength: 512 })),
  },
  { additionalProperties: false },
);

export type BuildRequestT = Static<typeof BuildRequest>;
