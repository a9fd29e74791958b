#!/usr/bin/perl
# Storage replication between two fewerbytes storages (two pools, two servers), in
# the steps Proxmox's replication runner takes for one disk: list each side's
# snapshots with volume_snapshot_info, pick the base as the last sync snapshot both
# sides hold with the same id (else the newest common one by timestamp), take a new
# `__replicate_JOB_TIME__` snapshot, then storage_migrate with that snapshot, the
# base and with_snapshots, onto the same volume name; then drop the older sync
# snapshot on both sides.
#
# What runs: the plugin against real servers, and storage_migrate as in t/40 (the
# stand-in in t/lib, or pve-storage's own with PVE_STORAGE_SRC). The runner's steps
# above are a shim written here (`replicate` below, from the behaviour of
# pve-guest-common's PVE::Replication, none of its code): no ssh, one job, one disk,
# no guest freeze, no state file.

use strict;
use warnings;

use File::Temp qw(tempdir);
use JSON;
use Test::More;

use FewerbytesTest;
use PVE::Storage;
use PVE::Storage::Custom::FewerbytesPlugin;

my $plugin = 'PVE::Storage::Custom::FewerbytesPlugin';
my $work = tempdir('fb-pve-replicate-XXXXXX', TMPDIR => 1, CLEANUP => 1);

between_nodes();

sub uri { return scalar($plugin->path($_[0], $_[1], 'x', $_[2])) }

my $src = start_server();
$plugin->activate_storage('fb', $src, {});
my $dst = start_server(keep => 1);
$plugin->activate_storage('fb2', $dst, {});
my $cfg_file = "$work/storage.json";
open(my $cfg_fh, '>', $cfg_file) or die "open: $!";
print $cfg_fh encode_json({ ids => { fb => $src, fb2 => $dst } });
close($cfg_fh);
$ENV{FEWERBYTES_TEST_STORAGE_CFG} = $cfg_file;
my $cfg = PVE::Storage::config();

my $disk = $plugin->alloc_image('fb', $src, 100, 'raw', undef, 16 * 1024);
ok($plugin->volume_has_feature($src, 'replicate', 'fb', $disk), 'replicate is offered');
ok($plugin->storage_can_replicate($src, 'fb', 'raw'), 'for raw disks');
run_ok('sh', '-c', "head -c 16M /dev/urandom > $work/os.raw");
run_ok('qemu-img', 'convert', '-n', '-f', 'raw', '-O', 'raw', "$work/os.raw", uri($src, $disk));
# A snapshot the user took: replication carries it along.
$plugin->volume_snapshot($src, 'fb', $disk, 'user1');

# One run of job 100-0 at time $now, with $last the time of the last sync (0: none).
# Returns the log of storage_migrate.
sub replicate {
    my ($now, $last) = @_;
    my $prefix = '__replicate_100-0_';
    my $last_snap = "$prefix${last}__";
    my $local = $plugin->volume_snapshot_info($src, 'fb', $disk);
    my $remote = $plugin->volume_snapshot_info($dst, 'fb2', $disk);
    my $common = sub {
        my ($snap) = @_;
        return $local->{$snap} && $remote->{$snap} && $local->{$snap}->{id} eq $remote->{$snap}->{id};
    };
    my $base;
    if ($common->($last_snap)) {
        $base = $last_snap;
    } else {
        my ($newest) = sort { $local->{$b}->{timestamp} <=> $local->{$a}->{timestamp} }
            grep { $common->($_) } keys %$local;
        $base = $newest;
    }
    die "No common base snapshot on volume fb:$disk\n" if !defined($base) && %$remote;
    my $sync = "$prefix${now}__";
    $plugin->volume_snapshot($src, 'fb', $disk, $sync);
    my @log;
    eval {
        PVE::Storage::storage_migrate($cfg, "fb:$disk", undef, 'fb2',
            { target_volname => $disk, base_snapshot => $base, snapshot => $sync,
                with_snapshots => 1 },
            sub { push @log, $_[0] });
    };
    if (my $err = $@) {
        $plugin->volume_snapshot_delete($src, 'fb', $disk, $sync);
        die $err . join("\n", @log);
    }
    # The older sync snapshot goes on both sides once the new one is there.
    for my $side ([$src, 'fb'], [$dst, 'fb2']) {
        my $info = $plugin->volume_snapshot_info($side->[0], $side->[1], $disk);
        for my $snap (grep { /^\Q$prefix\E/ && $_ ne $sync } keys %$info) {
            $plugin->volume_snapshot_delete($side->[0], $side->[1], $disk, $snap);
        }
    }
    return @log;
}

sub ids {
    my $info = $plugin->volume_snapshot_info(@_);
    return { map { $_ => $info->{$_}->{id} } keys %$info };
}

# First run: no common snapshot, a full sync of every snapshot up to the new one.
my @log = replicate(1000, 0);
ok((grep { /Sent volume 'vm-100-disk-0\@user1':/ } @log), 'the first run sends in full')
    or diag(join("\n", @log));
is_deeply([sort keys ids($dst, 'fb2', $disk)->%*], ['__replicate_100-0_1000__', 'user1'],
    'the target holds the user snapshot and the sync snapshot');
is_deeply(ids($dst, 'fb2', $disk), ids($src, 'fb', $disk), 'with the same ids on both sides');
images_identical(uri($src, $disk, '__replicate_100-0_1000__'), uri($dst, $disk),
    'the replica holds the disk as the sync snapshot took it');

# The guest writes 1 MiB; the second run sends only that, from the common snapshot.
run_ok('qemu-io', '-f', 'raw', '-c', 'write -P 0x42 2M 1M', uri($src, $disk));
@log = replicate(2000, 1000);
ok((grep { /Sent volume 'vm-100-disk-0\@p\.__replicate_100-0_2000__' \(changes since 'vm-100-disk-0\@p\.__replicate_100-0_1000__'\): 1 blocks of data, 255 by reference/ } @log),
    'the second run sends the 1 MiB written since the last sync') or diag(join("\n", @log));
ok((grep { /updated in place/ } @log), 'onto the replica, in place') or diag(join("\n", @log));
is_deeply([sort keys ids($dst, 'fb2', $disk)->%*], ['__replicate_100-0_2000__', 'user1'],
    'the older sync snapshot is gone on the target');
is_deeply(ids($dst, 'fb2', $disk), ids($src, 'fb', $disk), 'the ids still match');
images_identical(uri($src, $disk, '__replicate_100-0_2000__'), uri($dst, $disk), 'the replica is current');
images_identical(uri($src, $disk, 'user1'), uri($dst, $disk, 'user1'), 'and the user snapshot kept');

# A snapshot of the sync snapshot's name but another identity is no common base: the
# only other common one (user1) is taken, and the increment from it, which would make
# the sync snapshot of that name again on the target, is refused.
$plugin->volume_snapshot_delete($dst, 'fb2', $disk, '__replicate_100-0_2000__');
$plugin->volume_snapshot($dst, 'fb2', $disk, '__replicate_100-0_2000__');
run_ok('qemu-io', '-f', 'raw', '-c', 'write -P 0x43 5M 512k', uri($src, $disk));
my $before = ids($dst, 'fb2', $disk);
eval { replicate(3000, 2000) };
like($@, qr/has a snapshot 'vm-100-disk-0\@p\.__replicate_100-0_2000__' already/,
    'a run from an older common snapshot, past a target snapshot of another identity, is refused');
is_deeply(ids($dst, 'fb2', $disk), $before, 'and the target keeps its snapshots');

stop_server();
done_testing();
