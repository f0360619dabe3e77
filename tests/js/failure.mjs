// What the JS tests print for a call expected to throw: null when it did not throw, or the
// error's [name, message] (the Python side compares those with E2B's error classes).
export const failure = async (call) => {
  try {
    await call()
    return null
  } catch (e) {
    return [e.name, String(e.message)]
  }
}
