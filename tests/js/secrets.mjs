// Secrets through the newest E2B JavaScript SDK, against the server at E2B_API_URL.
// Prints one JSON line: what each call returned, or the error it threw ([name, message]).
import { Secret } from 'e2b'
import { failure } from './failure.mjs'

const out = {}

const made = await Secret.create('JS-Token', 'js-value-never-shown', { metadata: { k: 'v' } })
out.made = made
out.dup = await failure(() => Secret.create('js-token', 'again'))
out.updated = await Secret.update('js-token', 'v2', { metadata: {} })
out.byId = await Secret.getInfo(made.secretId)
out.exists = [await Secret.exists('js-token'), await Secret.exists('js-missing')]
out.missing = await failure(() => Secret.getInfo('js-missing'))
for (let i = 0; i < 3; i++) await Secret.create(`js-page-${i}`, 'x')
const paginator = Secret.list({ limit: 2 })
out.listed = []
while (paginator.hasNext) out.listed.push(...(await paginator.nextItems()).map((s) => s.name))
out.fill = Secret.fill('js-token')
for (let i = 0; i < 3; i++) await Secret.destroy(`js-page-${i}`)
out.destroyed = [await Secret.destroy('js-token'), await Secret.destroy('js-token')]
console.log(JSON.stringify(out))
