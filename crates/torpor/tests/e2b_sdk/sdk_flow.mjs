// The official, unmodified e2b JavaScript SDK against torpor: the same flow as sdk_flow.py.
// Environment: E2B_API_KEY, E2B_API_URL, E2B_SANDBOX_URL, OTHER_KEY; E2B_JS_DIR (where
// `npm install e2b` was run). Prints one line per step; exits non-zero on the first failure.
import { createRequire } from 'node:module'
import path from 'node:path'

const require = createRequire(path.join(process.env.E2B_JS_DIR, 'package.json'))
const { Sandbox, NotFoundError, AuthenticationError, CommandExitError } = require('e2b')
const sleep = (ms) => new Promise((r) => setTimeout(r, ms))
function expect(cond, what) { if (!cond) throw new Error('expectation failed: ' + what) }
function step(name) { console.log('step: ' + name) }

const RUN = String(process.pid)
step('create')
const sbx = await Sandbox.create({ metadata: { suite: 'e2b-js', run: RUN }, timeoutMs: 600_000 })
expect((await sbx.getInfo()).state === 'running', 'running')

step('run plain')
let r = await sbx.commands.run('echo hello; echo oops >&2')
expect(r.exitCode === 0 && r.stdout === 'hello\n' && r.stderr === 'oops\n', JSON.stringify(r))

step('run non-zero exit')
try { await sbx.commands.run('exit 3'); throw new Error('no CommandExitError') }
catch (e) { expect(e instanceof CommandExitError && e.exitCode === 3, String(e)) }

step('run streaming')
const chunks = []
await sbx.commands.run('for i in 1 2 3; do echo line$i; sleep 0.2; done', { onStdout: (d) => chunks.push(d) })
expect(chunks.join('') === 'line1\nline2\nline3\n' && chunks.length >= 2, JSON.stringify(chunks))

step('background + kill')
const h = await sbx.commands.run('sleep 600', { background: true })
expect((await sbx.commands.list()).some((p) => p.pid === h.pid), 'listed')
expect(await h.kill(), 'kill')

step('stdin')
const c = await sbx.commands.run('cat', { background: true, stdin: true })
await sbx.commands.sendStdin(c.pid, 'piped\n')
await sbx.commands.closeStdin(c.pid)
r = await c.wait()
expect(r.stdout === 'piped\n', JSON.stringify(r.stdout))

step('files')
await sbx.files.write('/home/user/js/a.txt', 'alpha')
expect((await sbx.files.read('/home/user/js/a.txt')) === 'alpha', 'read')
expect((await sbx.files.list('/home/user/js')).map((e) => e.name).join() === 'a.txt', 'list')
await sbx.files.remove('/home/user/js/a.txt')
expect(!(await sbx.files.exists('/home/user/js/a.txt')), 'removed')

step('list with metadata filter')
const found = await Sandbox.list({ query: { metadata: { suite: 'e2b-js', run: RUN } } }).nextItems()
expect(found.length === 1 && found[0].sandboxId === sbx.sandboxId, JSON.stringify(found))

step('pause + connect with a live process')
const p = await sbx.commands.run("python3 -u -c 'import sys\nn=0\nwhile True:\n  l=sys.stdin.readline()\n  if not l: break\n  n+=1\n  print(n, flush=True)\n'", { background: true, stdin: true })
await sbx.commands.sendStdin(p.pid, 'a\n')
await sleep(500)
await sbx.pause()
expect((await Sandbox.getInfo(sbx.sandboxId)).state === 'paused', 'paused')
const sbx2 = await Sandbox.connect(sbx.sandboxId)
const h2 = await sbx2.commands.connect(p.pid)
await sbx2.commands.sendStdin(p.pid, 'b\n')
await sbx2.commands.closeStdin(p.pid)
r = await h2.wait()
expect(r.stdout === '2\n', 'counter after wake ' + JSON.stringify(r.stdout))

step('errors')
try { await Sandbox.connect('sb-unknown000000000'); throw new Error('connected to an unknown id') }
catch (e) { expect(e instanceof NotFoundError, String(e)) }
try { await Sandbox.create({ apiKey: 'tpr_nobody_wrong' }); throw new Error('bad key accepted') }
catch (e) { expect(e instanceof AuthenticationError, String(e)) }
try { await Sandbox.connect(sbx.sandboxId, { apiKey: process.env.OTHER_KEY }); throw new Error('another tenant connected') }
catch (e) { expect(e instanceof NotFoundError, String(e)) }

step('kill')
await sbx2.kill()
console.log('ALL OK')
