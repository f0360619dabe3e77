// Volumes through the newest E2B JavaScript SDK, against the server at E2B_API_URL (the
// content calls at E2B_VOLUME_API_URL): the control plane, the volume's file API, and a
// sandbox that mounts it (volumeMounts) and reads and writes it from a command.
// Prints one JSON line: what each call returned, or the error it threw ([name, message]).
import { Sandbox, Volume } from 'e2b'
import { failure } from './failure.mjs'

const out = {}

const vol = await Volume.create('js-volume')
out.created = { name: vol.name, id: vol.volumeId.startsWith('vol_'), token: vol.token.length > 0 }
try {
  out.dir = (await vol.makeDir('/notes')).type
  const st = await vol.writeFile('/notes/hello.txt', 'from the js sdk\n', { mode: 0o640 })
  out.stat = { name: st.name, type: st.type, size: st.size, mode: st.mode, uid: st.uid,
    mtime: st.mtime instanceof Date }
  out.read = await vol.readFile('/notes/hello.txt')
  out.bytes = (await vol.readFile('/notes/hello.txt', { format: 'bytes' })).length
  out.listed = (await vol.list('/notes')).map((e) => e.name)
  out.exists = [await vol.exists('/notes/hello.txt'), await vol.exists('/nope')]
  out.overwrite = await failure(() => vol.writeFile('/notes/hello.txt', 'again'))
  out.missing = await failure(() => vol.getInfo('/nope'))
  out.mode = (await vol.updateMetadata('/notes/hello.txt', { mode: 0o600 })).mode
  out.connected = (await Volume.connect(vol.volumeId)).name
  out.info = (await Volume.getInfo(vol.volumeId)).name
  out.inList = (await Volume.list()).some((v) => v.volumeId === vol.volumeId)

  const sbx = await Sandbox.create('base', { volumeMounts: { '/mnt/js': vol },
    timeoutMs: 300_000 })
  try {
    out.guestRead = (await sbx.commands.run('cat /mnt/js/notes/hello.txt')).stdout
    await sbx.commands.run('echo from-the-guest > /mnt/js/notes/guest.txt')
    out.apiRead = await vol.readFile('/notes/guest.txt')
    out.mounts = (await sbx.getInfo()).volumeMounts
  } finally {
    await sbx.kill()
  }
  await vol.remove('/notes')
  out.removed = !(await vol.exists('/notes'))
} finally {
  out.destroyed = [await Volume.destroy(vol.volumeId), await Volume.destroy(vol.volumeId)]
}
out.gone = await failure(() => Volume.getInfo(vol.volumeId))
console.log(JSON.stringify(out))
