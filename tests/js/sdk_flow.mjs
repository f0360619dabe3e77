// The newest E2B JavaScript SDK from npm, configured only through E2B_API_URL,
// E2B_SANDBOX_URL and E2B_API_KEY. Prints one JSON line of results; any failure exits 1.
// With AENV_JS_ENVD_ONLY=1 it skips calls a single-envd test control plane cannot answer.
import { Sandbox } from 'e2b'

const envdOnly = process.env.AENV_JS_ENVD_ONLY === '1'
const out = {}
// A fresh directory per run: with envd on the host, a run killed midway must not leave
// files that the next run's listing sees.
const dir = `/home/user/js-${process.pid}-${Date.now()}`
const sbx = await Sandbox.create('base', { metadata: { lang: 'js' } })
try {
  out.running = await sbx.isRunning()
  const echo = await sbx.commands.run('echo hello from js; echo err >&2')
  out.stdout = echo.stdout
  out.stderr = echo.stderr
  const chunks = []
  await sbx.commands.run('for i in 1 2 3; do echo $i; sleep 0.1; done', {
    onStdout: (d) => chunks.push(d),
  })
  out.streamed = chunks.join('')
  try {
    await sbx.commands.run('exit 3')
    out.exitError = 'none'
  } catch (e) {
    out.exitError = e.exitCode
  }
  const bg = await sbx.commands.run('sleep 30', { background: true })
  out.listed = (await sbx.commands.list()).some((p) => p.pid === bg.pid)
  out.killed = await sbx.commands.kill(bg.pid)
  await sbx.files.write(`${dir}/dir/a.txt`, 'from js')
  out.read = await sbx.files.read(`${dir}/dir/a.txt`)
  out.entries = (await sbx.files.list(dir, { depth: 2 })).map((e) => e.name)
  out.exists = await sbx.files.exists(`${dir}/dir/a.txt`)
  const info = await sbx.files.getInfo(`${dir}/dir/a.txt`)
  out.mode = info.mode
  const events = []
  const watcher = await sbx.files.watchDir(dir, (ev) => events.push(ev.type), {
    recursive: true,
  })
  await sbx.files.write(`${dir}/dir/b.txt`, 'watched')
  await new Promise((r) => setTimeout(r, 500))
  await watcher.stop()
  out.watched = events.length > 0
  await sbx.files.remove(dir)
  out.removed = !(await sbx.files.exists(dir))
  const pty = await sbx.pty.create({ cols: 80, rows: 24, onData: () => {} })
  await sbx.pty.kill(pty.pid)
  out.pty = pty.pid > 0
  if (!envdOnly) {
    const page = await Sandbox.list({ query: { metadata: { lang: 'js' } } }).nextItems()
    out.listedSandbox = page.some((s) => s.sandboxId === sbx.sandboxId)
  }
} finally {
  out.killedSandbox = await sbx.kill()
}
console.log(JSON.stringify(out))
