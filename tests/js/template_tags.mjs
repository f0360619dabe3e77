// Template tags through the newest E2B JavaScript SDK, against the server at E2B_API_URL,
// on a template AENV_JS_TEMPLATE built with the tag v1 (by the Python test that runs this).
// Prints one JSON line: what each call returned, or the error it threw ([name, message]).
import { Sandbox, Template } from 'e2b'
import { failure } from './failure.mjs'

const name = process.env.AENV_JS_TEMPLATE
const out = {}

const assigned = await Template.assignTags(`${name}:v1`, 'js')
out.assigned = assigned
out.tags = (await Template.getTags(name)).map((t) => ({
  tag: t.tag,
  buildId: t.buildId,
  createdAtIsDate: t.createdAt instanceof Date && !Number.isNaN(t.createdAt.getTime()),
}))
out.tagsByEncodedRef = (await Template.getTags(`${name}:v1`)).map((t) => t.tag)
const sbx = await Sandbox.create(`${name}:js`)
try {
  out.content = (await sbx.commands.run('cat /home/user/build.txt')).stdout
} finally {
  await sbx.kill()
}
out.removedReturnsUndefined = (await Template.removeTags(name, ['js'])) === undefined
out.tagsAfterRemove = (await Template.getTags(name)).map((t) => t.tag)
out.createRemoved = await failure(() => Sandbox.create(`${name}:js`))
out.existsRemoved = await Template.exists(`${name}:js`)
out.existsV1 = await Template.exists(`${name}:v1`)
out.assignInvalid = await failure(() => Template.assignTags(`${name}:v1`, ':invalid-tag'))
out.assignMissingTag = await failure(() => Template.assignTags(`${name}:v1`, `${name}:`))
out.assignUnknownTarget = await failure(() => Template.assignTags(`${name}:nope`, 'x'))
out.removeDefault = await failure(() => Template.removeTags(name, 'default'))
out.removeUnknown = await failure(() => Template.removeTags('nonexistent-aenv', ['tag']))
out.tagsUnknown = await failure(() => Template.getTags('nonexistent-aenv'))
console.log(JSON.stringify(out))
