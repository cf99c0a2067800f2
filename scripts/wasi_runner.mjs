// Cargo's runner for tests compiled to wasm32-wasip1 (make test-wasm32):
// runs the test binary under Node's WASI (preview1), with its arguments
// and environment, and exits with its status. A failing test panics, and a
// panic on wasm32-wasip1 aborts the binary (RuntimeError: unreachable): the
// status is then non-zero, the failing test is the last one named, and its
// message, captured by the harness, is lost (`-- --nocapture` shows it, as
// does the same test run natively). The proxy-wasm host calls
// the filter imports (module `env`) are linked to functions that throw:
// the core's tests never reach the host adapter.
//
// With WASI_SHARDS=N (N > 1) and no test named on the command line, the
// tests are listed, dealt to groups in turn, and the groups run by
// N runs of this runner at a time (a wasm32 test binary runs its tests on
// one thread), each group's output printed when it ends; the status is
// non-zero if any group's is.
import { spawn } from "node:child_process";
import { closeSync, mkdtempSync, openSync, readFileSync, rmSync } from "node:fs";
import { readFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import process, { argv, env, execPath, exit } from "node:process";
import { WASI } from "node:wasi";

const [file, ...args] = argv.slice(2);
const shards = Number(env.WASI_SHARDS ?? 1);
// Groups per parallel run, when sharded.
const PER_RUN = 8;
if (shards > 1 && args.every((a) => a.startsWith("-"))) {
  exit(await sharded(shards));
}

/**
 * Runs this runner on `file` with `more` arguments: [status, output]. The
 * child writes to a file, not a pipe: WASI writes to its fd 1 as it is, and
 * a pipe Node has made non-blocking fails a long write with EAGAIN
 * ("io error when listing tests: WouldBlock") when the reader is slow.
 */
function run(more) {
  const { WASI_SHARDS, ...rest } = env;
  const dir = mkdtempSync(join(tmpdir(), "wasi-runner-"));
  const path = join(dir, "out");
  const fd = openSync(path, "w");
  const child = spawn(execPath, [...process.execArgv, argv[1], file, ...more], {
    env: rest,
    stdio: ["ignore", fd, fd],
  });
  closeSync(fd);
  return new Promise((done) =>
    child.on("close", (code) => {
      const out = readFileSync(path, "utf8");
      rmSync(dir, { recursive: true, force: true });
      done([code ?? 1, out]);
    }),
  );
}

async function sharded(n) {
  const [listed, list] = await run(["--list", "--format", "terse"]);
  if (listed !== 0) {
    process.stdout.write(list);
    return listed;
  }
  const names = list.split("\n").filter((l) => l.endsWith(": test")).map((l) => l.slice(0, -": test".length));
  // Small groups taken from a queue by N runs at a time (starting a run
  // costs about half a second), the tests dealt to them in turn: a
  // module's slow tests, listed together, land in different groups.
  const count = Math.min(names.length, n * PER_RUN);
  const groups = Array.from({ length: count }, (_, g) => names.filter((_, k) => k % count === g));
  let status = 0;
  const worker = async () => {
    for (let g = groups.shift(); g; g = groups.shift()) {
      const [code, out] = await run([...args, "--exact", ...g]);
      process.stdout.write(out);
      status ||= code;
    }
  };
  await Promise.all(Array.from({ length: n }, worker));
  return status;
}

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
