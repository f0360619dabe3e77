/*
 * Preloaded into QEMU (LD_PRELOAD) by aenv.runtime.write_tracking: registers the guest RAM
 * mapping for userfaultfd write protection in asynchronous mode (Linux 6.7+), so that the
 * server can ask the kernel which guest pages were written since it last re-armed the
 * protection (the PAGEMAP_SCAN ioctl of /proc/PID/pagemap) instead of comparing every page
 * the guest ever wrote.
 *
 * A userfaultfd always belongs to the address space of the process that creates it, so
 * QEMU itself has to make it: this library does so right after QEMU maps the file named by
 * AENV_TRACK_WRITES privately and writable. In asynchronous mode the kernel resolves each
 * write fault itself (no thread reads the descriptor; it is only kept open, which keeps
 * the registration). Anything that fails leaves the mapping untracked, which the server
 * sees (the scan refuses a range that is not registered) and then compares every written
 * page as before.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <stdlib.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef UFFD_FEATURE_WP_UNPOPULATED
#define UFFD_FEATURE_WP_UNPOPULATED (1 << 13)
#endif
#ifndef UFFD_FEATURE_WP_ASYNC
#define UFFD_FEATURE_WP_ASYNC (1 << 15)
#endif

static dev_t target_dev;
static ino_t target_ino;
static int have_target;
static int uffd = -1;

__attribute__((constructor)) static void find_target(void)
{
    const char *path = getenv("AENV_TRACK_WRITES");
    struct stat st;

    if (path != NULL && stat(path, &st) == 0) {
        target_dev = st.st_dev;
        target_ino = st.st_ino;
        have_target = 1;
    }
}

static int is_target(int fd)
{
    struct stat st;

    return have_target && fstat(fd, &st) == 0 && st.st_dev == target_dev &&
           st.st_ino == target_ino;
}

static void track(void *addr, size_t len)
{
    struct uffdio_api api = {
        .api = UFFD_API,
        .features = UFFD_FEATURE_WP_ASYNC | UFFD_FEATURE_WP_UNPOPULATED,
    };
    struct uffdio_register reg = {
        .range = { .start = (unsigned long)addr, .len = len },
        .mode = UFFDIO_REGISTER_MODE_WP,
    };

    if (uffd == -1) {
        uffd = (int)syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK | UFFD_USER_MODE_ONLY);
        if (uffd < 0) {
            uffd = -2;
            return;
        }
        if (ioctl(uffd, UFFDIO_API, &api) < 0) {
            close(uffd);
            uffd = -2;
            return;
        }
    }
    if (uffd >= 0)
        ioctl(uffd, UFFDIO_REGISTER, &reg);
}

void *mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off)
{
    void *p = (void *)syscall(SYS_mmap, addr, len, prot, flags, fd, off);

    if (p != MAP_FAILED && fd >= 0 && (flags & MAP_PRIVATE) && (prot & PROT_WRITE) &&
        is_target(fd))
        track(p, len);
    return p;
}

void *mmap64(void *addr, size_t len, int prot, int flags, int fd, off_t off)
    __attribute__((alias("mmap")));
