// Cargo's runner for tests compiled to wasm32-wasip1 (make test-wasm32):
// runs the test binary under Node's WASI (preview1), with its arguments
// and environment, and exits with its status. A failing test panics, and a
// panic on wasm32-wasip1 aborts the binary (RuntimeError: unreachable): the
// status is then non-zero, the failing test is the last one named, and its
// message, captured by the harness, is lost (`-- --nocapture` shows it, as
// does the same test run natively). The proxy-wasm host calls
// the filter imports (module `env`) are linked to functions that throw:
// the core's tests never reach the host adapter.
import { readFile } from "node:fs/promises";
import { argv, env, exit } from "node:process";
import { WASI } from "node:wasi";

const [file, ...args] = argv.slice(2);
const wasi = new WASI({ version: "preview1", args: [file, ...args], env, returnOnExit: true });
const module = await WebAssembly.compile(await readFile(file));
const imports = wasi.getImportObject();
for (const i of WebAssembly.Module.imports(module)) {
  if (!(i.module in imports)) imports[i.module] = {};
  if (!(i.name in imports[i.module]) && i.kind === "function") {
    imports[i.module][i.name] = () => {
      throw new Error(`host call ${i.module}.${i.name} in a test`);
    };
  }
}
const instance = await WebAssembly.instantiate(module, imports);
// The test binary is a command (`_start`); the `_initialize` a dependency
// exports for reactors is not for it, and WASI's start refuses both.
const { _initialize, ...exports } = instance.exports;
exit(wasi.start({ exports }));
