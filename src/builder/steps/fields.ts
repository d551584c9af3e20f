// Field shapes shared by the declarative step variants. Strings that end up in Dockerfile lines without JSON
// quoting (ENV values, WORKDIR, USER) refuse control characters; everything else is quoted and may hold anything.

import { Type } from "typebox";

/** A path in the image: no NUL or line breaks; relative paths resolve against the working directory. */
export const StepPath = Type.String({ minLength: 1, maxLength: 4096, pattern: "^[^\\x00-\\x1f]+$" });
export const AbsolutePath = Type.String({ minLength: 1, maxLength: 4096, pattern: "^/[^\\x00-\\x1f]*$" });
export const StepUser = Type.String({ minLength: 1, maxLength: 64, pattern: "^[A-Za-z0-9_][A-Za-z0-9_.-]*$" });
export const StepMode = Type.String({ pattern: "^[0-7]{3,4}$" });
/** An argument that must never read as an option to the program it is passed to. */
export const Operand = Type.String({ minLength: 1, maxLength: 1024, pattern: "^[^-\\s\\x00][^\\s\\x00]*$" });
export const Packages = Type.Array(Operand, { minItems: 1, maxItems: 512 });
export const EnvName = "^[A-Za-z_][A-Za-z0-9_]*$";
export const EnvValue = Type.String({ maxLength: 65536, pattern: "^[^\\x00\\n\\r]*$" });
export const HttpUrl = Type.String({ minLength: 1, maxLength: 4096, pattern: "^https?://[^\\s\\x00]+$" });
