// The newest E2B JavaScript SDK pointed at aenv with TLS and wildcard DNS: only
// E2B_DOMAIN, E2B_API_KEY and NODE_EXTRA_CA_CERTS (the server's CA) are set. The sandbox
// serves a page on 8080, fetched at https:// + getHost(8080) with Node's own fetch.
// Run by tests/server/test_tls_e2e.py; prints one JSON line of results.
import { Sandbox } from 'e2b'

const PAGE = 'served to node over https\n'
const out = {}

async function fetchWhenUp(url, deadline) {
  for (;;) {
    const r = await fetch(url)
    // 502 ("port is not open") while the server in the sandbox starts
    if (r.status !== 502 || Date.now() > deadline) return [r.status, await r.text()]
    await new Promise((resolve) => setTimeout(resolve, 500))
  }
}

const sbx = await Sandbox.create('base', { timeoutMs: 600_000 })
try {
  out.sandboxId = sbx.sandboxId
  out.echo = (await sbx.commands.run('echo hello from node')).stdout
  await sbx.files.write('/home/user/www/index.html', PAGE)
  await sbx.commands.run('cd /home/user/www && exec python3 -m http.server 8080', {
    background: true,
  })
  out.host = sbx.getHost(8080)
  ;[out.status, out.body] = await fetchWhenUp(`https://${out.host}/index.html`,
    Date.now() + 180_000)
  out.page = PAGE
} finally {
  await sbx.kill()
}
console.log(JSON.stringify(out))
