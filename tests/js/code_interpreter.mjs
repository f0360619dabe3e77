// The newest @e2b/code-interpreter against aenv's code-interpreter-v1 (driven by
// tests/server/test_code_interpreter_e2e.py, which built the template and points
// E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY at the server). Prints one JSON line of what
// each call gave: values, an error, streamed callbacks with the milliseconds since the call
// began, a context of its own, restart and remove.
import { Sandbox } from '@e2b/code-interpreter'

const out = {}
const sbx = await Sandbox.create() // the SDK's default template: code-interpreter-v1
try {
  const first = await sbx.runCode('x = 6 * 7\nprint("out"); x')
  out.text = first.text
  out.stdout = first.logs.stdout
  out.executionCount = first.executionCount
  out.state = (await sbx.runCode('x + 1')).text

  const failed = await sbx.runCode('raise ValueError("from js")')
  out.error = failed.error && { name: failed.error.name, value: failed.error.value,
    tracebackHasName: failed.error.traceback.includes('ValueError') }

  // callbacks arrive while the cell runs: the first line long before the last
  const started = Date.now()
  const events = []
  const at = () => Date.now() - started
  const streamed = await sbx.runCode(
    'import sys, time\nprint("a", flush=True)\ntime.sleep(1.5)\n'
    + 'print("b", file=sys.stderr, flush=True)\n"done"', {
      onStdout: (m) => events.push(['stdout', m.line, at()]),
      onStderr: (m) => events.push(['stderr', m.line, at()]),
      onResult: (r) => events.push(['result', r.text, at()]),
    })
  out.events = events
  out.streamedMs = at()
  out.streamedText = streamed.text

  const onError = []
  await sbx.runCode('undefined_name', { onError: (e) => onError.push(e.name) })
  out.onError = onError

  out.envs = (await sbx.runCode('import os; os.environ["AENV_JS_RUN"]',
    { envs: { AENV_JS_RUN: 'per run' } })).text

  const ctx = await sbx.createCodeContext({ cwd: '/tmp' })
  out.context = { language: ctx.language, cwd: ctx.cwd }
  out.contextCwd = (await sbx.runCode('import os; os.getcwd()', { context: ctx })).text
  await sbx.runCode('y = "in ctx"', { context: ctx })
  out.contextOwnState = (await sbx.runCode('y', { context: ctx })).text
  out.defaultLacksIt = (await sbx.runCode('y')).error?.name ?? null
  out.listed = (await sbx.listCodeContexts()).some((c) => c.id === ctx.id)
  await sbx.restartCodeContext(ctx)
  out.afterRestart = (await sbx.runCode('y', { context: ctx })).error?.name ?? null
  await sbx.removeCodeContext(ctx)
  out.listedAfterRemove = (await sbx.listCodeContexts()).some((c) => c.id === ctx.id)
} finally {
  await sbx.kill()
}
console.log(JSON.stringify(out))
