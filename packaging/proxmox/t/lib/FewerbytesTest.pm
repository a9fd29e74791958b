package FewerbytesTest;

# What every plugin test shares: a real `fewerbytes serve` on a fresh pool in a
# temporary directory (stopped with SIGTERM when the test ends), the storage
# configuration Proxmox would hand the plugin for it, and the CLI to look at the pool
# the way an admin would.
#
# FEWERBYTES_BIN names the binary (default: target/release/fewerbytes of this
# repository; build it first with `cargo build --release -p fewerbytes`).

use strict;
use warnings;

use Cwd qw(abs_path);
use File::Basename qw(dirname);
use File::Temp qw(tempdir);
use JSON;
use POSIX qw(WNOHANG);
use Test::More;

use PVE::Storage;
use PVE::Storage::Custom::FewerbytesPlugin;

use base qw(Exporter);
our @EXPORT = qw(fewerbytes_bin start_server stop_server scfg cli cli_json run_ok STOREID
    between_nodes images_identical);

# Servers started before the current one and left running (`start_server(keep =>
# 1)`): a migration test holds two pools at once. Stopped when the test ends.
our @kept;

use constant STOREID => 'fb';
use constant PLUGIN => 'PVE::Storage::Custom::FewerbytesPlugin';

# How long the server may take to answer on its control socket.
my $START_LIMIT_S = 60;

my $REPO = abs_path(dirname(__FILE__) . '/../../../..');

sub fewerbytes_bin {
    my $bin = $ENV{FEWERBYTES_BIN} // "$REPO/target/release/fewerbytes";
    BAIL_OUT("no fewerbytes binary at $bin: run `cargo build --release -p fewerbytes`"
        . " or set FEWERBYTES_BIN") if !-x $bin;
    return $bin;
}

our %server;

# The storage.cfg entry of the test's storage.
sub scfg {
    return {
        type => 'fewerbytes',
        content => { images => 1 },
        'fewerbytes-pool' => $server{pool},
        'fewerbytes-socket' => $server{socket},
        'fewerbytes-control-socket' => $server{control},
    };
}

# Create a pool of $size (default 4G) in a new temporary directory; serve it unless
# told not to. Returns the scfg.
sub start_server {
    my (%opt) = @_;
    $PVE::Storage::Custom::FewerbytesPlugin::FEWERBYTES = fewerbytes_bin();
    push @kept, {%server} if $opt{keep} && $server{pid};
    my $dir = tempdir('fb-pve-XXXXXX', TMPDIR => 1, CLEANUP => !$ENV{FEWERBYTES_KEEP_TEMP});
    %server = (
        dir => $dir,
        pool => "$dir/vms.pool",
        socket => "$dir/vms.sock",
        control => "$dir/vms.ctl",
        log => "$dir/serve.log",
    );
    run_ok(fewerbytes_bin(), 'pool', 'create', $server{pool}, '--size', $opt{size} // '4G');
    serve() if !$opt{no_serve};
    return scfg();
}

# Start `fewerbytes serve` on the pool and wait until it answers.
sub serve {
    my $pid = fork() // die "fork: $!";
    if (!$pid) {
        open(STDOUT, '>>', $server{log}) or die "open $server{log}: $!";
        open(STDERR, '>&', \*STDOUT) or die "dup: $!";
        exec(fewerbytes_bin(), 'serve', '--pool', $server{pool}, '--socket', $server{socket},
            '--control-socket', $server{control}, '--no-tcp')
            or die "exec: $!";
    }
    $server{pid} = $pid;
    my $deadline = time() + $START_LIMIT_S;
    while (time() < $deadline) {
        if (waitpid($pid, WNOHANG) == $pid) {
            delete $server{pid};
            BAIL_OUT("fewerbytes serve exited before answering:\n" . server_log());
        }
        return if -S $server{socket} && eval { cli('pool', 'info'); 1 };
        select(undef, undef, undef, 0.1);
    }
    BAIL_OUT("fewerbytes serve did not answer within ${START_LIMIT_S}s:\n" . server_log());
}

sub server_log {
    open(my $fh, '<', $server{log}) or return '';
    local $/;
    return <$fh>;
}

# SIGTERM, as systemctl stop sends; the server flushes and exits 0.
sub stop_server {
    my $pid = delete $server{pid} // return;
    kill('TERM', $pid);
    waitpid($pid, 0);
    is($? >> 8, 0, 'the server exits 0 on SIGTERM') or diag(server_log());
}

END {
    my $status = $?;
    for my $pid (grep { defined } delete($server{pid}), map { $_->{pid} } @kept) {
        kill('TERM', $pid);
        waitpid($pid, 0);
    }
    $? = $status;
}

# Run a command; dies with its output unless it exits 0. Returns stdout.
sub run_ok {
    my (@cmd) = @_;
    my $out = '';
    my $err = '';
    eval {
        PVE::Tools::run_command(\@cmd, outfunc => sub { $out .= "$_[0]\n" },
            errfunc => sub { $err .= "$_[0]\n" }, timeout => 300);
    };
    die "@cmd: $@$out$err" if $@;
    return $out;
}

# For the tests that move disks between two storages (t/40, t/50): pve-storage's own
# code from a checkout when PVE_STORAGE_SRC names one (else the stand-in in t/lib),
# and t/bin's pvesm first on PATH, which runs the fewerbytes CLI this build made.
sub between_nodes {
    if (my $src = $ENV{PVE_STORAGE_SRC}) {
        my @loaded = PVE::Storage::load_pve_storage($src);
        note("pve-storage's own code from $src: @loaded");
    } else {
        note('PVE::Storage is the stand-in in t/lib (set PVE_STORAGE_SRC to a pve-storage'
            . ' checkout to run its own code)');
    }
    $ENV{PATH} = abs_path(dirname(__FILE__) . '/../bin') . ":$ENV{PATH}";
    $ENV{FEWERBYTES_BIN} = fewerbytes_bin();
}

# qemu-img compare finds the two raw images (files or NBD URIs) identical.
sub images_identical {
    my ($left, $right, $what) = @_;
    like(run_ok('qemu-img', 'compare', '-f', 'raw', '-F', 'raw', $left, $right),
        qr/Images are identical/, $what);
}

# The fewerbytes CLI on the served pool, as an admin runs it.
sub cli {
    my (@args) = @_;
    return run_ok(fewerbytes_bin(), '--pool', $server{pool}, '--control-socket',
        $server{control}, '--require-server', @args);
}

sub cli_json {
    my (@args) = @_;
    return decode_json(cli(@args, '--json'));
}

1;
