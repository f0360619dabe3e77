// Template.build of the newest E2B JavaScript SDK up to its COPY uploads, against the
// server at E2B_API_URL. The context is AENV_JS_CONTEXT; the build start is expected to
// fail (the test server has no base template). Prints one JSON line: each COPY step's
// [src, dest, filesHash] and whether the build failed.
import { Template } from 'e2b'

const template = Template({ fileContextPath: process.env.AENV_JS_CONTEXT })
  .fromTemplate('base')
  .copy('notes.txt', '/opt/notes.txt')
  .copy('*.bin', '/opt/')
  .copy('app', '/home/user/app/')
const out = { failed: false }
try {
  await Template.build(template, 'js-upload-test')
} catch (e) {
  out.failed = true
  out.error = String(e)
}
const steps = await template.instructionsWithHashes()
out.copies = steps.filter((s) => s.type === 'COPY').map((s) => [s.args[0], s.args[1], s.filesHash])
console.log(JSON.stringify(out))
