// A sandbox killed while a command runs, with the newest E2B JavaScript SDK (driven by
// tests/server/test_killed_mid_command_e2e.py). "background" is E2B's own
// sandboxKilledDuringRun.test.ts; "foreground" kills through the API while
// commands.run is still waiting. Prints one JSON line: per case the error's name, message
// and the milliseconds from the kill to the error, and the sandbox's id.
import { Sandbox } from 'e2b'

const sleep = (ms) => new Promise((r) => setTimeout(r, ms))
const describe = (sandbox, err, since) => ({
  sandboxId: sandbox.sandboxId,
  name: err?.name ?? String(err),
  message: err?.message ?? '',
  ms: Date.now() - since,
})
const out = {}

{
  const sandbox = await Sandbox.create('base')
  const cmd = await sandbox.commands.run('sleep 60', { background: true })
  await sandbox.kill()
  const since = Date.now()
  out.background = describe(sandbox, await cmd.wait().catch((e) => e), since)
}

{
  const sandbox = await Sandbox.create('base')
  const running = sandbox.commands.run('sleep 60', { timeoutMs: 120_000 }).catch((e) => e)
  for (let i = 0; i < 300; i++) {
    const procs = await sandbox.commands.list()
    if (procs.some((p) => [p.cmd, ...p.args].join(' ').endsWith('sleep 60'))) break
    await sleep(200)
  }
  await sleep(1000)
  const since = Date.now()
  await Sandbox.kill(sandbox.sandboxId)
  out.foreground = describe(sandbox, await running, since)
}

console.log(JSON.stringify(out))
